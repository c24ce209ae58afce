"""Class-conditional point-cloud diffusion with a transformer denoiser (classifier-free guidance).

    torchrun --nproc_per_node=8 08_pointcloud_dit.py --data_dir data/ShapeNetCore.v2.PC15k --cats all
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SYNSETS = {"airplane": "02691156", "car": "02958343", "chair": "03001627", "table": "04379243",
           "lamp": "03636649", "sofa": "04256520", "rifle": "04090263", "vessel": "04530566"}


class PC15k(Dataset):
    def __init__(self, root, cats, split="train", n_points=2048):
        self.items = []
        for label, cat in enumerate(cats):
            d = os.path.join(root, SYNSETS[cat], split)
            self.items += [(os.path.join(d, f), label) for f in sorted(os.listdir(d)) if f.endswith(".npy")]
        self.n_points = n_points
        # global normalisation stats from the training split
        self.mean = np.zeros((1, 3), np.float32)
        self.std = np.float32(0.15)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        pc = np.load(path).astype(np.float32)
        pc = pc[np.random.permutation(len(pc))[: self.n_points]]
        return torch.from_numpy((pc - self.mean) / self.std), label


class GaussianDiffusion:
    def __init__(self, num_steps=1000, schedule="cosine", device="cuda:0"):
        if schedule == "linear":
            betas = np.linspace(1e-4, 0.02, num_steps, dtype=np.float64)
        else:
            s = 0.008
            t = np.linspace(0, num_steps, num_steps + 1) / num_steps
            ac = np.cos((t + s) / (1 + s) * math.pi / 2) ** 2
            betas = np.clip(1 - ac[1:] / ac[:-1], 0, 0.999)
        alphas_cumprod = np.cumprod(1.0 - betas)
        to = lambda a: torch.tensor(a, dtype=torch.float32, device=device)
        self.num_steps = num_steps
        self.betas = to(betas)
        self.sqrt_ac = to(np.sqrt(alphas_cumprod))
        self.sqrt_1m_ac = to(np.sqrt(1.0 - alphas_cumprod))
        self.alphas_cumprod = to(alphas_cumprod)

    def q_sample(self, x0, t, noise):
        return self.sqrt_ac[t].view(-1, 1, 1) * x0 + self.sqrt_1m_ac[t].view(-1, 1, 1) * noise

    def training_loss(self, model, x0, y):
        t = torch.randint(0, self.num_steps, (x0.shape[0],), device=x0.device)
        noise = torch.randn_like(x0)
        pred = model(self.q_sample(x0, t, noise), t, y)
        return F.mse_loss(pred, noise)

    @torch.no_grad()
    def ddim_sample(self, model, shape, y, steps=100, guidance=2.0, null_label=0):
        x = torch.randn(shape, device=y.device)
        ts = torch.linspace(self.num_steps - 1, 0, steps, device=y.device).long()
        for i, t in enumerate(ts):
            tt = t.repeat(shape[0])
            eps_c = model(x, tt, y)
            eps_u = model(x, tt, torch.full_like(y, null_label))
            eps = eps_u + guidance * (eps_c - eps_u)
            a = self.alphas_cumprod[t]
            a_prev = self.alphas_cumprod[ts[i + 1]] if i + 1 < len(ts) else torch.ones_like(a)
            x0 = (x - (1 - a).sqrt() * eps) / a.sqrt()
            x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps
        return x


class AdaLNBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.ada = nn.Linear(dim, 6 * dim)
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)

    def forward(self, x, c):
        s1, b1, g1, s2, b2, g2 = self.ada(c).unsqueeze(1).chunk(6, dim=-1)
        h = self.norm1(x) * (1 + s1) + b1
        x = x + g1 * self.attn(h, h, h, need_weights=False)[0]
        h = self.norm2(x) * (1 + s2) + b2
        return x + g2 * self.mlp(h)


class PointDiT(nn.Module):
    def __init__(self, num_classes, dim=384, depth=12, heads=6, n_tokens=256):
        super().__init__()
        self.dim, self.n_tokens = dim, n_tokens
        self.in_proj = nn.Linear(3, dim)
        self.t_embed = nn.Sequential(nn.Linear(256, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.y_embed = nn.Embedding(num_classes + 1, dim)  # index 0 = unconditional
        self.blocks = nn.ModuleList([AdaLNBlock(dim, heads) for _ in range(depth)])
        self.out_norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, 3)

    def timestep_features(self, t):
        half = 128
        f = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
        a = t.float()[:, None] * f[None]
        return torch.cat([a.sin(), a.cos()], -1)

    def forward(self, x, t, y):
        c = self.t_embed(self.timestep_features(t)) + self.y_embed(y)
        h = self.in_proj(x)
        for blk in self.blocks:
            h = blk(h, c)
        return self.out(self.out_norm(h))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--cats", default="all")
    ap.add_argument("--out_dir", default="runs/pc_dit")
    ap.add_argument("--global_batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=2000)
    ap.add_argument("--p_uncond", type=float, default=0.1)
    ap.add_argument("--save_every", type=int, default=50)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1000 + rank)
    torch.backends.cuda.matmul.allow_tf32 = True

    cats = list(SYNSETS) if args.cats == "all" else args.cats.split(",")
    ds = PC15k(args.data_dir, cats)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.global_batch // world, sampler=sampler,
                        num_workers=8, pin_memory=True, drop_last=True, persistent_workers=True)

    diffusion = GaussianDiffusion(1000, "cosine")
    model = DDP(PointDiT(len(cats)).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start_epoch = ck["epoch"] + 1

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        tic, tot = time.time(), torch.zeros(2, device=device)
        for x0, y in loader:
            x0 = x0.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True) + 1
            drop = torch.rand(y.shape, device=device) < args.p_uncond
            y = torch.where(drop, torch.zeros_like(y), y)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = diffusion.training_loss(model, x0, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            tot += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.5f} {time.time() - tic:.0f}s", flush=True)

        if (epoch + 1) % args.save_every == 0:
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                            "cats": cats}, os.path.join(args.out_dir, f"ckpt_{epoch + 1}.pt"))
                net = model.module.eval()
                y = torch.arange(1, len(cats) + 1, device=device).repeat_interleave(4)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pcs = diffusion.ddim_sample(net, (len(y), 2048, 3), y)
                np.save(os.path.join(args.out_dir, f"samples_{epoch + 1}.npy"),
                        (pcs.float().cpu().numpy() * ds.std + ds.mean))
                net.train()
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
