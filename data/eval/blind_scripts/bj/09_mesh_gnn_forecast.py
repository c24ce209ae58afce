"""Encode-process-decode mesh GNN for medium-range forecasting (GraphCast-like, 1 deg).

The grid->mesh, mesh->mesh and mesh->grid graphs are precomputed (icosahedral mesh,
refinement level 5) and stored in graph_r5.pt.  The processor is a single
interaction network applied n_steps times (shared weights) to keep the parameter
count small; activations are recomputed in the backward pass to fit 16 steps in memory.

    torchrun --nnodes=4 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        09_mesh_gnn_forecast.py --steps 16 --latent 512
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def mlp(din, dout, hidden, ln=True):
    layers = [nn.Linear(din, hidden), nn.SiLU(), nn.Linear(hidden, dout)]
    if ln:
        layers.append(nn.LayerNorm(dout))
    return nn.Sequential(*layers)


def scatter_sum(src, index, n):
    out = src.new_zeros(n, src.shape[-1])
    return out.index_add_(0, index, src)


class InteractionNetwork(nn.Module):
    """Edge update followed by node update, residual on both (batched over dim 0)."""

    def __init__(self, d):
        super().__init__()
        self.edge_mlp = mlp(3 * d, d, d)
        self.node_mlp = mlp(2 * d, d, d)

    def forward(self, h_src, h_dst, e, src, dst):
        # h_*: (N, D) with the batch folded into the node dimension
        e_new = self.edge_mlp(torch.cat([e, h_src[src], h_dst[dst]], dim=-1))
        agg = scatter_sum(e_new, dst, h_dst.shape[0])
        h_dst = h_dst + self.node_mlp(torch.cat([h_dst, agg], dim=-1))
        return h_dst, e + e_new


class MeshGNN(nn.Module):
    def __init__(self, graph, n_vars, n_static, latent, n_steps):
        super().__init__()
        self.n_steps = n_steps
        for k in ["g2m_src", "g2m_dst", "m2m_src", "m2m_dst", "m2g_src", "m2g_dst"]:
            self.register_buffer(k, graph[k], persistent=False)
        self.register_buffer("g2m_feat", graph["g2m_feat"], persistent=False)
        self.register_buffer("m2m_feat", graph["m2m_feat"], persistent=False)
        self.register_buffer("m2g_feat", graph["m2g_feat"], persistent=False)
        self.register_buffer("mesh_feat", graph["mesh_feat"], persistent=False)
        self.n_grid = graph["n_grid"]
        self.n_mesh = graph["mesh_feat"].shape[0]
        self.grid_embed = mlp(2 * n_vars + n_static, latent, latent)
        self.mesh_embed = mlp(self.mesh_feat.shape[1], latent, latent)
        self.g2m_embed = mlp(self.g2m_feat.shape[1], latent, latent)
        self.m2m_embed = mlp(self.m2m_feat.shape[1], latent, latent)
        self.m2g_embed = mlp(self.m2g_feat.shape[1], latent, latent)
        self.encoder = InteractionNetwork(latent)
        self.processor = InteractionNetwork(latent)
        self.decoder = InteractionNetwork(latent)
        self.out = mlp(latent, n_vars, latent, ln=False)

    @staticmethod
    def _batched(idx, n, B):
        offs = torch.arange(B, device=idx.device).repeat_interleave(idx.shape[0]) * n
        return idx.repeat(B) + offs

    def forward(self, x_prev, x_cur, static):
        B, V = x_cur.shape[0], x_cur.shape[1]
        grid = torch.cat([x_prev, x_cur, static.expand(B, -1, -1, -1)], 1).flatten(2).transpose(1, 2)
        hg = self.grid_embed(grid).reshape(B * self.n_grid, -1)
        hm = self.mesh_embed(self.mesh_feat).repeat(B, 1)
        g2m_s, g2m_d = self._batched(self.g2m_src, self.n_grid, B), self._batched(self.g2m_dst, self.n_mesh, B)
        m2m_s, m2m_d = self._batched(self.m2m_src, self.n_mesh, B), self._batched(self.m2m_dst, self.n_mesh, B)
        m2g_s, m2g_d = self._batched(self.m2g_src, self.n_mesh, B), self._batched(self.m2g_dst, self.n_grid, B)

        hm, _ = self.encoder(hg, hm, self.g2m_embed(self.g2m_feat).repeat(B, 1), g2m_s, g2m_d)
        e = self.m2m_embed(self.m2m_feat).repeat(B, 1)
        for _ in range(self.n_steps):
            hm, e = checkpoint(self.processor, hm, hm, e, m2m_s, m2m_d)
        hg, _ = self.decoder(hm, hg, self.m2g_embed(self.m2g_feat).repeat(B, 1), m2g_s, m2g_d)
        delta = self.out(hg).reshape(B, -1, V).transpose(1, 2).reshape_as(x_cur)
        return x_cur + delta


class ERA5Pairs(Dataset):
    """(x_{t-6h}, x_t) -> x_{t+6h}, normalised with per-variable mean and std."""

    def __init__(self, path, mean, std):
        self.arr = np.load(path, mmap_mode="r")  # (T, V, 181, 360) float32
        self.mean, self.std = mean[:, None, None], std[:, None, None]

    def __len__(self):
        return self.arr.shape[0] - 2

    def __getitem__(self, i):
        x = (np.asarray(self.arr[i: i + 3]) - self.mean) / self.std
        x = torch.from_numpy(x.astype(np.float32))
        return x[0], x[1], x[2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train", default="/lus/eagle/projects/wx/era5_1deg/train_1979_2015.npy")
    p.add_argument("--val", default="/lus/eagle/projects/wx/era5_1deg/val_2016_2017.npy")
    p.add_argument("--stats", default="/lus/eagle/projects/wx/era5_1deg/stats.npz")
    p.add_argument("--graph", default="/lus/eagle/projects/wx/graphs/graph_r5.pt")
    p.add_argument("--static", default="/lus/eagle/projects/wx/era5_1deg/static.npy")
    p.add_argument("--latent", type=int, default=512)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch", type=int, default=1, help="per GPU")
    p.add_argument("--out", default="/lus/eagle/projects/wx/runs/mesh_gnn")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    stats = np.load(args.stats)
    mean, std = stats["mean"].astype(np.float32), stats["std"].astype(np.float32)
    graph = torch.load(args.graph, map_location="cpu")
    static = torch.from_numpy(np.load(args.static)).float()[None].to(device)

    train_ds, val_ds = ERA5Pairs(args.train, mean, std), ERA5Pairs(args.val, mean, std)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_sub = Subset(val_ds, list(range(rank * 4, len(val_ds), world * 4)))  # every 24 h, sharded
    val_loader = DataLoader(val_sub, batch_size=1, num_workers=2)

    model = MeshGNN(graph, n_vars=len(mean), n_static=static.shape[1], latent=args.latent,
                    n_steps=args.steps).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total = args.epochs * len(loader)
    warm = 1000
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + np.cos(np.pi * min(s, total) / total)))

    lat = torch.linspace(90, -90, 181, device=device)
    w = torch.cos(torch.deg2rad(lat)).clamp(min=1e-3)
    w = (w / w.mean()).view(1, 1, -1, 1)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (xp, xc, xn) in enumerate(loader):
            xp, xc, xn = (t.to(device, non_blocking=True) for t in (xp, xc, xn))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(xp, xc, static)
            loss = (w * (pred.float() - xn) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 32.0)
            opt.step()
            sched.step()
            if rank == 0 and i % 100 == 0:
                print(f"ep {epoch} it {i}/{len(loader)} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)

        model.eval()
        acc = torch.zeros(len(mean) + 1, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for xp, xc, xn in val_loader:
                xp, xc, xn = xp.to(device), xc.to(device), xn.to(device)
                err = w * (model.module(xp, xc, static).float() - xn) ** 2
                acc[:-1] += err.mean(dim=(-2, -1)).sum(0)
                acc[-1] += xp.shape[0]
        dist.all_reduce(acc)
        rmse = (acc[:-1] / acc[-1]).sqrt() * torch.as_tensor(std, device=device)
        if rank == 0:
            print(f"epoch {epoch} val 6h RMSE {np.round(rmse.cpu().numpy(), 3).tolist()} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, os.path.join(args.out, f"ckpt_{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
