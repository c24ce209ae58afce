"""Instant-NGP for unbounded 360 captures with a multi-level (cascaded) occupancy grid, DDP.

Optionally starts from a field pretrained on another capture of the same place
(--init, a checkpoint written by this script or by the old DataParallel version).

    torchrun --nproc_per_node=4 ngp_360.py --data data/360_v2/garden --run garden_ngp
"""
import argparse
import json
import math
import os
from collections import OrderedDict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP

import nerfacc
import tinycudann as tcnn
from nerfacc.estimators.occ_grid import OccGridEstimator


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--out_root", default="runs")
    p.add_argument("--init", default=None)
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--rays", type=int, default=8192, help="rays per step summed over GPUs")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--grid_levels", type=int, default=4)
    p.add_argument("--grid_res", type=int, default=128)
    p.add_argument("--step_size", type=float, default=math.sqrt(3) * 2 / 1024)
    p.add_argument("--cone_angle", type=float, default=1 / 256)
    p.add_argument("--downscale", type=int, default=4)
    p.add_argument("--eval_every", type=int, default=5000)
    return p.parse_args()


class Field(nn.Module):
    def __init__(self, aabb):
        super().__init__()
        self.register_buffer("aabb", aabb)
        self.mlp_base = tcnn.NetworkWithInputEncoding(
            3, 16,
            {"otype": "HashGrid", "n_levels": 16, "n_features_per_level": 2, "log2_hashmap_size": 19,
             "base_resolution": 16, "per_level_scale": math.exp(math.log(4096 / 16) / 15)},
            {"otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "None",
             "n_neurons": 64, "n_hidden_layers": 1})
        self.dir_enc = tcnn.Encoding(3, {"otype": "SphericalHarmonics", "degree": 4})
        self.mlp_head = tcnn.Network(31, 3, {"otype": "FullyFusedMLP", "activation": "ReLU",
                                             "output_activation": "Sigmoid", "n_neurons": 64, "n_hidden_layers": 2})

    def _contract(self, x):
        lo, hi = self.aabb[:3], self.aabb[3:]
        x = (x - lo) / (hi - lo) * 2 - 1
        n = x.abs().max(-1, keepdim=True).values
        x = torch.where(n > 1, (2 - 1 / n) * x / n, x)
        return x / 4 + 0.5

    def query_density(self, x, return_feat=False):
        h = self.mlp_base(self._contract(x).view(-1, 3)).float()
        sigma = torch.exp(h[:, 0].clamp(max=15) - 1)
        return (sigma, h[:, 1:]) if return_feat else sigma

    def forward(self, x, d):
        sigma, feat = self.query_density(x, return_feat=True)
        rgb = self.mlp_head(torch.cat([self.dir_enc((d + 1) / 2), feat], -1)).float()
        return rgb, sigma


def load(root, downscale):
    meta = json.load(open(os.path.join(root, "transforms.json")))
    frames = sorted(meta["frames"], key=lambda f: f["file_path"])
    ims, c2w = [], []
    for f in frames:
        im = Image.open(os.path.join(root, f["file_path"]))
        im = im.resize((im.width // downscale, im.height // downscale), Image.LANCZOS)
        ims.append(np.asarray(im, np.uint8)[..., :3])
        c2w.append(np.array(f["transform_matrix"], np.float32))
    c2w = np.stack(c2w)
    c2w[:, :3, 3] -= c2w[:, :3, 3].mean(0)
    c2w[:, :3, 3] /= np.abs(c2w[:, :3, 3]).max()
    K = np.array([meta["fl_x"], meta["fl_y"], meta["cx"], meta["cy"]], np.float32) / downscale
    return torch.from_numpy(np.stack(ims)), torch.from_numpy(c2w), torch.from_numpy(K)


def rays(c2w, K, x, y):
    d = torch.stack([(x + 0.5 - K[2]) / K[0], -(y + 0.5 - K[3]) / K[1], -torch.ones_like(x)], -1)
    rd = F.normalize((c2w[..., :3, :3] @ d[..., None]).squeeze(-1), dim=-1)
    return c2w[..., :3, 3].expand_as(rd).contiguous(), rd


def render(ddp_or_field, field, est, ro, rd, step_size, cone_angle, bg, train):
    def sigma_fn(t0, t1, ri):
        x = ro[ri] + rd[ri] * ((t0 + t1) / 2)[:, None]
        return field.query_density(x)

    def rgb_sigma_fn(t0, t1, ri):
        x = ro[ri] + rd[ri] * ((t0 + t1) / 2)[:, None]
        return ddp_or_field(x, rd[ri])

    ri, t0, t1 = est.sampling(ro, rd, sigma_fn=sigma_fn, near_plane=0.02, render_step_size=step_size,
                              cone_angle=cone_angle, alpha_thre=1e-2 if train else 0.0, stratified=train)
    rgb, acc, _, _ = nerfacc.rendering(t0, t1, ri, n_rays=ro.shape[0], rgb_sigma_fn=rgb_sigma_fn, render_bkgd=bg)
    return rgb


def main():
    a = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    ray_gen = torch.Generator(device=dev).manual_seed(777 + rank)

    out_dir = os.path.join(a.out_root, a.run)
    # non-zero ranks get a disabled (no-op) run so wandb.log calls below are harmless
    wandb.init(project="ngp-360", name=a.run, config=vars(a), dir=a.out_root,
               mode="online" if rank == 0 else "disabled")
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    ims, c2w, K = load(a.data, a.downscale)
    test_ids = list(range(0, ims.shape[0], 8))
    train_ids = [i for i in range(ims.shape[0]) if i % 8]
    tr_ims, tr_c2w, K = ims[train_ids].to(dev), c2w[train_ids].to(dev), K.to(dev)
    H, W = ims.shape[1:3]

    aabb = torch.tensor([-1.0, -1.0, -1.0, 1.0, 1.0, 1.0])
    field = Field(aabb).to(dev)
    if a.init:
        sd = torch.load(a.init, map_location="cpu")
        sd = sd.get("field", sd)
        sd = OrderedDict((k[7:] if k.startswith("module.") else k, v) for k, v in sd.items())
        field.load_state_dict(sd)
    est = OccGridEstimator(roi_aabb=aabb, resolution=a.grid_res, levels=a.grid_levels).to(dev)
    # the only buffer is the constant aabb, nothing to re-broadcast each forward
    model = DDP(field, device_ids=[local_rank], broadcast_buffers=False)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr, eps=1e-15, weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.ChainedScheduler([
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=100),
        torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[a.steps // 2, a.steps * 3 // 4, a.steps * 9 // 10], gamma=0.33),
    ])
    scaler = torch.cuda.amp.GradScaler(2 ** 10)
    n = a.rays // world

    for step in range(1, a.steps + 1):
        model.train()
        est.train()

        def occ_eval_fn(x):
            return field.query_density(x) * a.step_size

        est.update_every_n_steps(step=step, occ_eval_fn=occ_eval_fn, occ_thre=1e-2)
        if step % 16 == 0:
            # each rank probed random points of its own: merge so every rank skips the same space
            dist.all_reduce(est.occs, op=dist.ReduceOp.MAX)
            est.binaries = (est.occs > torch.clamp(est.occs.mean(), max=1e-2)).view(est.binaries.shape)

        i = torch.randint(0, len(train_ids), (n,), device=dev, generator=ray_gen)
        x = torch.randint(0, W, (n,), device=dev, generator=ray_gen)
        y = torch.randint(0, H, (n,), device=dev, generator=ray_gen)
        ro, rd = rays(tr_c2w[i], K, x.float(), y.float())
        target = tr_ims[i, y, x].float() / 255.0
        pred = render(model, field, est, ro, rd, a.step_size, a.cone_angle, torch.zeros(3, device=dev), True)
        loss = F.smooth_l1_loss(pred, target)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()

        if step % 100 == 0:
            l = loss.detach().clone()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            wandb.log({"train/loss": l.item(), "lr": sched.get_last_lr()[0],
                       "occupancy": est.binaries.float().mean().item()}, step=step)

        if step % a.eval_every == 0 or step == a.steps:
            field.eval()
            est.eval()
            m = torch.zeros(2, device=dev)
            yy, xx = torch.meshgrid(torch.arange(H, device=dev).float(), torch.arange(W, device=dev).float(), indexing="ij")
            with torch.no_grad():
                for k in test_ids[rank::world]:
                    ro, rd = rays(c2w[k].to(dev).expand(H * W, 4, 4), K, xx.reshape(-1), yy.reshape(-1))
                    pred = torch.cat([render(field, field, est, ro[s:s + 8192], rd[s:s + 8192], a.step_size,
                                             a.cone_angle, torch.zeros(3, device=dev), False)
                                      for s in range(0, H * W, 8192)]).view(H, W, 3)
                    m[0] += -10 * torch.log10(F.mse_loss(pred, ims[k].to(dev).float() / 255.0))
                    m[1] += 1
            dist.all_reduce(m)
            wandb.log({"test/psnr": (m[0] / m[1]).item()}, step=step)
            if rank == 0:
                print(f"step {step}: test PSNR {(m[0] / m[1]).item():.2f} on {int(m[1].item())} views", flush=True)
                torch.save({"field": field.state_dict(), "estimator": est.state_dict(), "step": step},
                           os.path.join(out_dir, "ckpt.pt"))
            dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
