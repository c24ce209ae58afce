"""Direct voxel grid optimisation (DVGO-style fine stage) for unbounded-ish scenes.

Explicit density grid + feature grid with a shallow colour MLP. Samples per ray
are dense, so the colour MLP is evaluated in chunks with activation
checkpointing to keep the memory per GPU bounded.

    torchrun --nproc_per_node=4 13_dvgo_fine_stage.py --config configs/tnt/truck.yaml
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.tensorboard import SummaryWriter


class VoxelNeRF(nn.Module):
    def __init__(self, xyz_min, xyz_max, res, k0_dim=12, rgbnet_width=128, viewbase_pe=4, chunk=1 << 18):
        super().__init__()
        self.register_buffer("xyz_min", torch.tensor(xyz_min, dtype=torch.float32))
        self.register_buffer("xyz_max", torch.tensor(xyz_max, dtype=torch.float32))
        self.density = nn.Parameter(torch.zeros(1, 1, *res))
        self.k0 = nn.Parameter(torch.zeros(1, k0_dim, *res))
        self.viewbase_pe = viewbase_pe
        self.chunk = chunk
        dim_in = k0_dim + 3 + 3 * viewbase_pe * 2
        self.rgbnet = nn.Sequential(nn.Linear(dim_in, rgbnet_width), nn.ReLU(True),
                                    nn.Linear(rgbnet_width, rgbnet_width), nn.ReLU(True),
                                    nn.Linear(rgbnet_width, 3))
        nn.init.constant_(self.rgbnet[-1].bias, 0)
        self.act_shift = math.log(1 / (1 - 1e-4) - 1)

    def grid_sample(self, grid, xyz):
        ind = ((xyz - self.xyz_min) / (self.xyz_max - self.xyz_min)).flip(-1) * 2 - 1
        return F.grid_sample(grid, ind.view(1, 1, 1, -1, 3), mode="bilinear", align_corners=True).view(grid.shape[1], -1).T

    def forward(self, rays_o, rays_d, near, far, stepsize, perturb=True):
        n_steps = int(((self.xyz_max - self.xyz_min).norm() / stepsize).item()) + 1
        t = near + torch.arange(n_steps, device=rays_o.device, dtype=torch.float32) * stepsize
        t = t[None].expand(rays_o.shape[0], -1)
        if perturb:
            t = t + torch.rand_like(t[:, :1]) * stepsize
        d = F.normalize(rays_d, dim=-1)
        pts = rays_o[:, None] + d[:, None] * t[..., None]
        mask = ((pts >= self.xyz_min) & (pts <= self.xyz_max)).all(-1) & (t <= far)
        ray_id = torch.arange(rays_o.shape[0], device=rays_o.device)[:, None].expand_as(t)[mask]
        p = pts[mask]

        sigma = self.grid_sample(self.density, p).squeeze(-1)
        alpha = 1 - torch.exp(-F.softplus(sigma + self.act_shift) * stepsize)
        # per-ray transmittance over the packed samples
        log_t = torch.log(1 - alpha + 1e-10)
        cum = torch.zeros(rays_o.shape[0], t.shape[1], device=t.device)
        cum[mask] = log_t
        T = torch.exp(torch.cumsum(cum, -1) - cum)[mask]
        w = T * alpha

        k0 = self.grid_sample(self.k0, p)
        vd = d[ray_id]
        freqs = 2.0 ** torch.arange(self.viewbase_pe, device=vd.device)
        vemb = (vd[..., None] * freqs).flatten(-2)
        h = torch.cat([k0, vd, vemb.sin(), vemb.cos()], -1)
        rgb = torch.cat([checkpoint(self.rgbnet, h[s:s + self.chunk], use_reentrant=True)
                         for s in range(0, h.shape[0], self.chunk)])
        rgb = torch.sigmoid(rgb)

        out = torch.zeros(rays_o.shape[0], 3, device=rays_o.device).index_add_(0, ray_id, w[:, None] * rgb)
        acc = torch.zeros(rays_o.shape[0], device=rays_o.device).index_add_(0, ray_id, w)
        return out + (1 - acc[:, None]) * 1.0, acc

    def total_variation(self, grid):
        tv = (grid[:, :, 1:] - grid[:, :, :-1]).pow(2).mean()
        tv = tv + (grid[:, :, :, 1:] - grid[:, :, :, :-1]).pow(2).mean()
        return tv + (grid[:, :, :, :, 1:] - grid[:, :, :, :, :-1]).pow(2).mean()


def load_rays(cfg):
    """Rays + colours written by our preprocessing (one npz per scene)."""
    npz = np.load(cfg["data"]["rays_npz"])
    return (torch.from_numpy(npz["rays_o"]), torch.from_numpy(npz["rays_d"]), torch.from_numpy(npz["rgb"]),
            torch.from_numpy(npz["test_rays_o"]), torch.from_numpy(npz["test_rays_d"]),
            torch.from_numpy(npz["test_rgb"]), npz["test_hw"], npz["xyz_min"], npz["xyz_max"],
            float(npz["near"]), float(npz["far"]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))
    tcfg = cfg["train"]

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(tcfg["seed"] + rank)

    ro, rd, rgb, tro, trd, trgb, test_hw, xyz_min, xyz_max, near, far = load_rays(cfg)
    res = [int(r) for r in cfg["model"]["res"]]
    voxel = float(np.prod((xyz_max - xyz_min) / np.array(res)) ** (1 / 3))
    stepsize = 0.5 * voxel

    model = VoxelNeRF(xyz_min.tolist(), xyz_max.tolist(), res, k0_dim=cfg["model"]["k0_dim"]).to(device)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.Adam([
        {"params": [model.module.density], "lr": tcfg["lr_density"]},
        {"params": [model.module.k0], "lr": tcfg["lr_k0"]},
        {"params": model.module.rgbnet.parameters(), "lr": tcfg["lr_rgbnet"]},
    ], betas=(0.9, 0.99))
    decay = 0.1 ** (1 / tcfg["iters"])
    writer = SummaryWriter(cfg["out_dir"]) if rank == 0 else None
    n_rays = tcfg["batch_rays"] // world

    for it in range(1, tcfg["iters"] + 1):
        sel = torch.randint(0, ro.shape[0], (n_rays,))
        o, d, c = ro[sel].to(device), rd[sel].to(device), rgb[sel].to(device)
        pred, acc = model(o, d, near, far, stepsize)
        mse = F.mse_loss(pred, c)
        loss = mse + tcfg["w_entropy"] * -(acc * torch.log(acc + 1e-10) + (1 - acc) * torch.log(1 - acc + 1e-10)).mean()
        if it < tcfg["tv_until"]:
            loss = loss + tcfg["w_tv_density"] * model.module.total_variation(model.module.density)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        for g in optim.param_groups:
            g["lr"] *= decay

        if it % 500 == 0:
            m = mse.detach().clone()
            dist.all_reduce(m, op=dist.ReduceOp.AVG)
            if rank == 0:
                writer.add_scalar("train/psnr", -10 * math.log10(m.item()), it)
                print(f"iter {it:6d}  psnr {-10 * math.log10(m.item()):.2f}", flush=True)

    # test images, interleaved over ranks
    net = model.module.eval()
    H, W = (int(v) for v in test_hw)
    per_img = H * W
    n_test = trgb.shape[0] // per_img
    s = torch.zeros(2, device=device)
    with torch.no_grad():
        for i in range(rank, n_test, world):
            sl = slice(i * per_img, (i + 1) * per_img)
            o, d, gt = tro[sl].to(device), trd[sl].to(device), trgb[sl].to(device)
            img = torch.cat([net(o[j:j + 8192], d[j:j + 8192], near, far, stepsize, perturb=False)[0]
                             for j in range(0, per_img, 8192)])
            s[0] += -10 * torch.log10(F.mse_loss(img, gt))
            s[1] += 1
    dist.all_reduce(s)
    if rank == 0:
        print(f"test PSNR {(s[0] / s[1]).item():.2f} over {int(s[1].item())} views")
        torch.save({"model": net.state_dict(), "cfg": cfg}, os.path.join(cfg["out_dir"], "fine_last.tar"))
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
