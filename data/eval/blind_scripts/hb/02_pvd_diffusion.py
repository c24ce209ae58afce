"""DDPM on ShapeNet point clouds (single category), PointNet-style denoiser.

torchrun --nproc_per_node=8 02_pvd_diffusion.py --cfg configs/chair.yaml
"""
import argparse
import copy
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class ShapeNetPC(Dataset):
    """ShapeNetCore.v2.PC15k layout: <root>/<synset>/<split>/<id>.npy, 15k points each."""

    def __init__(self, root, synset, split, n_points=2048, normalize="shape_unit"):
        d = os.path.join(root, synset, split)
        self.files = sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".npy"))
        self.n_points = n_points
        self.normalize = normalize

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        pc = np.load(self.files[i]).astype(np.float32)
        idx = np.random.choice(pc.shape[0], self.n_points, replace=False)
        pc = pc[idx]
        if self.normalize == "shape_unit":
            pc = pc - pc.mean(0, keepdims=True)
            pc = pc / np.abs(pc).max()
        return torch.from_numpy(pc)


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.sin(args), torch.cos(args)], dim=-1)


class SharedMLP(nn.Sequential):
    def __init__(self, cin, cout):
        super().__init__(nn.Conv1d(cin, cout, 1), nn.BatchNorm1d(cout), nn.SiLU())


class PointDenoiser(nn.Module):
    def __init__(self, width=256, t_dim=128):
        super().__init__()
        self.t_dim = t_dim
        self.t_mlp = nn.Sequential(nn.Linear(t_dim, width), nn.SiLU(), nn.Linear(width, width))
        self.local1 = SharedMLP(3, 128)
        self.local2 = SharedMLP(128 + width, width)
        self.glob = nn.Sequential(SharedMLP(width, 512), SharedMLP(512, 1024))
        self.head = nn.Sequential(SharedMLP(width + 1024, 512), SharedMLP(512, 256),
                                  nn.Conv1d(256, 3, 1))

    def forward(self, x, t):
        # x: B x N x 3
        h = x.transpose(1, 2)
        temb = self.t_mlp(timestep_embedding(t, self.t_dim))
        h = self.local1(h)
        h = self.local2(torch.cat([h, temb[:, :, None].expand(-1, -1, h.shape[-1])], 1))
        g = self.glob(h).max(-1, keepdim=True)[0].expand(-1, -1, h.shape[-1])
        return self.head(torch.cat([h, g], 1)).transpose(1, 2)


class GaussianDiffusion(nn.Module):
    def __init__(self, steps=1000, beta_start=1e-4, beta_end=0.02):
        super().__init__()
        betas = torch.linspace(beta_start, beta_end, steps, dtype=torch.float64)
        alphas_cumprod = torch.cumprod(1 - betas, 0)
        self.steps = steps
        self.register_buffer("betas", betas.float())
        self.register_buffer("sqrt_ac", alphas_cumprod.sqrt().float())
        self.register_buffer("sqrt_1m_ac", (1 - alphas_cumprod).sqrt().float())
        prev = torch.cat([torch.ones(1, dtype=torch.float64), alphas_cumprod[:-1]])
        self.register_buffer("post_var", (betas * (1 - prev) / (1 - alphas_cumprod)).float())
        self.register_buffer("recip_sqrt_a", (1 / (1 - betas).sqrt()).float())

    def q_sample(self, x0, t, noise):
        return self.sqrt_ac[t][:, None, None] * x0 + self.sqrt_1m_ac[t][:, None, None] * noise

    def loss(self, net, x0):
        t = torch.randint(0, self.steps, (x0.shape[0],), device=x0.device)
        noise = torch.randn_like(x0)
        return F.mse_loss(net(self.q_sample(x0, t, noise), t), noise)

    @torch.no_grad()
    def sample(self, net, shape, device):
        x = torch.randn(shape, device=device)
        for i in reversed(range(self.steps)):
            t = torch.full((shape[0],), i, device=device, dtype=torch.long)
            eps = net(x, t)
            mean = self.recip_sqrt_a[i] * (x - self.betas[i] / self.sqrt_1m_ac[i] * eps)
            x = mean + (self.post_var[i].sqrt() * torch.randn_like(x) if i > 0 else 0)
        return x


@torch.no_grad()
def ema_update(ema, model, decay):
    for pe, pm in zip(ema.parameters(), model.parameters()):
        pe.mul_(decay).add_(pm.detach(), alpha=1 - decay)
    for be, bm in zip(ema.buffers(), model.buffers()):
        be.copy_(bm)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    ap.add_argument("--resume", default="")
    cli = ap.parse_args()
    with open(cli.cfg) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"] + rank)
    np.random.seed(cfg["seed"] + rank)

    ds = ShapeNetPC(cfg["data_root"], cfg["synset"], "train", cfg["n_points"])
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    # cfg["batch_size"] is the global batch; gradient accumulation keeps it fixed
    accum = cfg.get("accum_steps", 1)
    per_gpu = cfg["batch_size"] // (world * accum)
    loader = DataLoader(ds, batch_size=per_gpu, sampler=sampler, num_workers=cfg["workers"],
                        pin_memory=True, drop_last=True)

    net = PointDenoiser(cfg["width"])
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    ema = copy.deepcopy(net).eval().requires_grad_(False)
    diffusion = GaussianDiffusion(cfg["steps"]).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["wd"])

    out_dir = cfg["out_dir"]
    start_epoch, step = 0, 0
    if cli.resume:
        ckpt = torch.load(cli.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        ema.load_state_dict(ckpt["ema"])
        opt.load_state_dict(ckpt["opt"])
        start_epoch, step = ckpt["epoch"] + 1, ckpt["step"]

    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        wandb.init(project="pc-diffusion", config=cfg, dir=out_dir,
                   resume="allow", id=cfg.get("run_id"))

    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(2, device=device)
        opt.zero_grad(set_to_none=True)
        for i, x0 in enumerate(loader):
            x0 = x0.to(device, non_blocking=True)
            last_micro = (i + 1) % accum == 0
            if last_micro:
                loss = diffusion.loss(model, x0) / accum
                loss.backward()
            else:
                with model.no_sync():
                    loss = diffusion.loss(model, x0) / accum
                    loss.backward()
            running += torch.stack([loss.detach() * accum, torch.ones((), device=device)])
            if not last_micro:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
            opt.step()
            opt.zero_grad(set_to_none=True)
            ema_update(ema, model.module, cfg["ema_decay"])
            step += 1

            if step % cfg["log_every"] == 0:
                dist.all_reduce(running)
                if rank == 0:
                    wandb.log({"loss": (running[0] / running[1]).item(), "epoch": epoch}, step=step)
                running.zero_()

        if (epoch + 1) % cfg["ckpt_every"] == 0:
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "ema": ema.state_dict(),
                            "opt": opt.state_dict(), "epoch": epoch, "step": step},
                           os.path.join(out_dir, f"ckpt_{epoch:04d}.pt"))
                pcs = diffusion.sample(ema, (8, cfg["n_points"], 3), device).cpu().numpy()
                np.save(os.path.join(out_dir, f"samples_{epoch:04d}.npy"), pcs)
                wandb.log({"samples": [wandb.Object3D(p) for p in pcs[:4]]}, step=step)
            dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
