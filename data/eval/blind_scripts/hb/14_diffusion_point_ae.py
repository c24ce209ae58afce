"""Diffusion point-cloud auto-encoder (PointNet encoder -> latent -> conditional DDPM decoder).

    torchrun --nproc_per_node=4 14_diffusion_point_ae.py --dataset_path data/shapenet.hdf5 --categories airplane
"""
import argparse
import math
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

cate_to_synsetid = {"airplane": "02691156", "bag": "02773838", "car": "02958343", "chair": "03001627"}


class ShapeNetCore(Dataset):
    def __init__(self, path, cates, split, scale_mode="shape_unit"):
        self.pointclouds = []
        with h5py.File(path, "r") as f:
            for c in cates:
                for pc in f[cate_to_synsetid[c]][split]:
                    pc = torch.from_numpy(pc).float()
                    if scale_mode == "shape_unit":
                        shift = pc.mean(0, keepdim=True)
                        scale = pc.flatten().std().view(1, 1)
                    else:
                        shift, scale = torch.zeros(1, 3), torch.ones(1, 1)
                    self.pointclouds.append(((pc - shift) / scale, shift, scale))

    def __len__(self):
        return len(self.pointclouds)

    def __getitem__(self, i):
        pc, shift, scale = self.pointclouds[i]
        return {"pointcloud": pc, "shift": shift, "scale": scale}


class PointNetEncoder(nn.Module):
    def __init__(self, zdim):
        super().__init__()
        self.convs = nn.Sequential(nn.Conv1d(3, 128, 1), nn.GroupNorm(8, 128), nn.ReLU(),
                                   nn.Conv1d(128, 256, 1), nn.GroupNorm(8, 256), nn.ReLU(),
                                   nn.Conv1d(256, 512, 1), nn.GroupNorm(8, 512), nn.ReLU(),
                                   nn.Conv1d(512, 512, 1))
        self.fc = nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, zdim))

    def forward(self, x):
        return self.fc(self.convs(x.transpose(1, 2)).max(-1)[0])


class ConcatSquashLinear(nn.Module):
    def __init__(self, cin, cout, ctx):
        super().__init__()
        self.layer = nn.Linear(cin, cout)
        self.gate = nn.Linear(ctx, cout)
        self.bias = nn.Linear(ctx, cout, bias=False)

    def forward(self, ctx, x):
        return self.layer(x) * torch.sigmoid(self.gate(ctx)) + self.bias(ctx)


class PointwiseNet(nn.Module):
    def __init__(self, zdim):
        super().__init__()
        ctx = zdim + 3
        dims = [3, 128, 256, 512, 256, 128, 3]
        self.layers = nn.ModuleList([ConcatSquashLinear(a, b, ctx) for a, b in zip(dims[:-1], dims[1:])])

    def forward(self, x, beta, z):
        beta = beta.view(-1, 1, 1)
        ctx = torch.cat([beta, torch.sin(beta), torch.cos(beta), z.unsqueeze(1)], -1)
        out = x
        for i, layer in enumerate(self.layers):
            out = layer(ctx, out)
            if i < len(self.layers) - 1:
                out = F.leaky_relu(out)
        return x + out


class DiffusionAE(nn.Module):
    def __init__(self, zdim=256, num_steps=200, beta_1=1e-4, beta_T=0.05):
        super().__init__()
        self.encoder = PointNetEncoder(zdim)
        self.net = PointwiseNet(zdim)
        betas = torch.cat([torch.zeros(1), torch.linspace(beta_1, beta_T, num_steps)])
        alphas = 1 - betas
        alpha_bars = torch.cumprod(alphas, 0)
        sigmas = torch.zeros_like(betas)
        sigmas[1:] = ((1 - alpha_bars[:-1]) / (1 - alpha_bars[1:]) * betas[1:]).sqrt()
        self.num_steps = num_steps
        self.register_buffer("betas", betas)
        self.register_buffer("alphas", alphas)
        self.register_buffer("alpha_bars", alpha_bars)
        self.register_buffer("sigmas", sigmas)

    def encode(self, x):
        return self.encoder(x)

    def forward(self, x0):
        z = self.encoder(x0)
        B = x0.shape[0]
        t = torch.randint(1, self.num_steps + 1, (B,), device=x0.device)
        ab = self.alpha_bars[t].view(-1, 1, 1)
        e = torch.randn_like(x0)
        pred = self.net(ab.sqrt() * x0 + (1 - ab).sqrt() * e, self.betas[t], z)
        return F.mse_loss(pred, e)

    @torch.no_grad()
    def sample(self, z, num_points, flexibility=0.0):
        x = torch.randn(z.shape[0], num_points, 3, device=z.device)
        for t in range(self.num_steps, 0, -1):
            noise = torch.randn_like(x) if t > 1 else torch.zeros_like(x)
            a, ab = self.alphas[t], self.alpha_bars[t]
            sigma = flexibility * self.sigmas[t] + (1 - flexibility) * self.betas[t].sqrt()
            eps = self.net(x, self.betas[t].expand(z.shape[0]), z)
            x = (x - (1 - a) / (1 - ab).sqrt() * eps) / a.sqrt() + sigma * noise
        return x


def chamfer(a, b):
    d = torch.cdist(a, b)
    return d.min(2)[0].pow(2).mean(1) + d.min(1)[0].pow(2).mean(1)


@torch.no_grad()
def validate(model, loader, device, max_batches=8):
    cds = []
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        ref = batch["pointcloud"].to(device)
        shift, scale = batch["shift"].to(device), batch["scale"].to(device)
        z = model.encode(ref)
        rec = model.sample(z, ref.shape[1], flexibility=0.0)
        cds.append(chamfer(rec * scale + shift, ref * scale + shift).cpu())
    return torch.cat(cds).mean().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset_path", required=True)
    ap.add_argument("--categories", default="airplane")
    ap.add_argument("--latent_dim", type=int, default=256)
    ap.add_argument("--num_steps", type=int, default=200)
    ap.add_argument("--train_batch_size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max_iters", type=int, default=400000)
    ap.add_argument("--val_freq", type=int, default=2000)
    ap.add_argument("--log_root", default="logs_ae")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2020 + rank)

    cates = args.categories.split(",")
    train_set = ShapeNetCore(args.dataset_path, cates, "train")
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_set, batch_size=args.train_batch_size // world, sampler=sampler,
                          num_workers=4, drop_last=True, pin_memory=True)

    model = DDP(DiffusionAE(args.latent_dim, args.num_steps).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda it: 1.0 if it < 150000 else max(0.01, 1 - (it - 150000) / 150000))

    log_dir = os.path.join(args.log_root, f"AE_{'_'.join(cates)}_{time.strftime('%Y_%m_%d__%H_%M_%S')}")
    writer = None
    if rank == 0:
        os.makedirs(log_dir, exist_ok=True)
        writer = SummaryWriter(log_dir)
        val_dl = DataLoader(ShapeNetCore(args.dataset_path, cates, "val"), batch_size=32, num_workers=0)

    it, epoch, best = 0, 0, math.inf
    while it < args.max_iters:
        sampler.set_epoch(epoch)
        for batch in train_dl:
            x = batch["pointcloud"].to(device, non_blocking=True)
            loss = model(x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            it += 1
            if rank == 0 and it % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), it)
                writer.add_scalar("train/grad_norm", grad_norm.item(), it)

            if it % args.val_freq == 0:
                if rank == 0:
                    cd = validate(model, val_dl, device)
                    writer.add_scalar("val/cd", cd, it)
                    print(f"[it {it}] val CD {cd:.6f}", flush=True)
                    ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "it": it, "args": vars(args)}
                    torch.save(ckpt, os.path.join(log_dir, f"ckpt_{it}.pt"))
                    if cd < best:
                        best = cd
                        torch.save(ckpt, os.path.join(log_dir, "ckpt_best.pt"))
                dist.barrier()
            if it >= args.max_iters:
                break
        epoch += 1

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
