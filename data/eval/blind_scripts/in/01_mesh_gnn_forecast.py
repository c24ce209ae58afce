"""Encode-process-decode mesh GNN for 6-hourly global forecasting on a 1.0 deg ERA5 grid.

Launch with torchrun; one process per GPU.
"""
import argparse
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("meshgnn")

VARIABLES = ["z500", "t850", "t2m", "u10", "v10", "msl", "q700", "u850", "v850"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="/lustre/era5/1.0deg_npy")
    p.add_argument("--graph", default="/lustre/era5/graphs/icosa_r5_1.0deg.pt")
    p.add_argument("--out-dir", default="/lustre/runs/meshgnn")
    p.add_argument("--train-years", default="1979-2015")
    p.add_argument("--val-years", default="2016-2017")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--warmup-steps", type=int, default=1000)
    p.add_argument("--loss", choices=["mse", "nll"], default="mse")
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--resume", default="")
    return p.parse_args()


def parse_years(s):
    a, b = s.split("-")
    return list(range(int(a), int(b) + 1))


class ERA5Pairs(Dataset):
    """(x_{t-1}, x_t) -> x_{t+1}, 6-hourly steps, one memmapped array per year."""

    def __init__(self, root, years, mean, std):
        self.arrays = [np.load(os.path.join(root, f"{y}.npy"), mmap_mode="r") for y in years]
        self.index = [(i, t) for i, a in enumerate(self.arrays) for t in range(1, a.shape[0] - 1)]
        self.mean = mean[:, None, None]
        self.std = std[:, None, None]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k):
        i, t = self.index[k]
        a = self.arrays[i]
        seq = (np.asarray(a[t - 1:t + 2], dtype=np.float32) - self.mean) / self.std
        return torch.from_numpy(seq[:2].copy()), torch.from_numpy(seq[2].copy())


class MLP(nn.Sequential):
    def __init__(self, d_in, d_out, d_hidden=None, norm=True):
        d_hidden = d_hidden or d_out
        layers = [nn.Linear(d_in, d_hidden), nn.SiLU(), nn.Linear(d_hidden, d_out)]
        if norm:
            layers.append(nn.LayerNorm(d_out))
        super().__init__(*layers)


class InteractionNetwork(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.edge_mlp = MLP(3 * dim, dim)
        self.node_mlp = MLP(2 * dim, dim)

    def forward(self, x_src, x_dst, e, src, dst):
        m = self.edge_mlp(torch.cat([e, x_src[:, src], x_dst[:, dst]], dim=-1))
        agg = torch.zeros_like(x_dst).index_add_(1, dst, m)
        x_dst = x_dst + self.node_mlp(torch.cat([x_dst, agg], dim=-1))
        return x_dst, e + m


class MeshForecaster(nn.Module):
    def __init__(self, graph, n_vars, dim, n_layers):
        super().__init__()
        for k in ("g2m_src", "g2m_dst", "mesh_src", "mesh_dst", "m2g_src", "m2g_dst"):
            self.register_buffer(k, graph[k].long(), persistent=False)
        self.register_buffer("grid_static", graph["grid_static"].float(), persistent=False)
        self.register_buffer("mesh_feat", graph["mesh_feat"].float(), persistent=False)
        self.register_buffer("g2m_efeat", graph["g2m_efeat"].float(), persistent=False)
        self.register_buffer("mesh_efeat", graph["mesh_efeat"].float(), persistent=False)
        self.register_buffer("m2g_efeat", graph["m2g_efeat"].float(), persistent=False)

        self.grid_embed = MLP(2 * n_vars + self.grid_static.shape[-1], dim)
        self.mesh_embed = MLP(self.mesh_feat.shape[-1], dim)
        self.g2m_eembed = MLP(self.g2m_efeat.shape[-1], dim)
        self.mesh_eembed = MLP(self.mesh_efeat.shape[-1], dim)
        self.m2g_eembed = MLP(self.m2g_efeat.shape[-1], dim)
        self.encoder = InteractionNetwork(dim)
        self.processor = nn.ModuleList([InteractionNetwork(dim) for _ in range(n_layers)])
        self.decoder = InteractionNetwork(dim)
        self.head = MLP(dim, n_vars, norm=False)
        self.logvar_head = nn.Linear(dim, n_vars)

    def forward(self, x, return_logvar=False):
        # x: (B, 2, C, H, W)
        B, _, C, H, W = x.shape
        grid_in = x.reshape(B, 2 * C, H * W).transpose(1, 2)
        static = self.grid_static.unsqueeze(0).expand(B, -1, -1)
        g = self.grid_embed(torch.cat([grid_in, static], dim=-1))
        m = self.mesh_embed(self.mesh_feat).unsqueeze(0).expand(B, -1, -1)

        e = self.g2m_eembed(self.g2m_efeat).unsqueeze(0).expand(B, -1, -1)
        m, _ = self.encoder(g, m, e, self.g2m_src, self.g2m_dst)
        e = self.mesh_eembed(self.mesh_efeat).unsqueeze(0).expand(B, -1, -1)
        for layer in self.processor:
            m, e = layer(m, m, e, self.mesh_src, self.mesh_dst)
        e = self.m2g_eembed(self.m2g_efeat).unsqueeze(0).expand(B, -1, -1)
        g, _ = self.decoder(m, g, e, self.m2g_src, self.m2g_dst)

        delta = self.head(g).transpose(1, 2).reshape(B, C, H, W)
        out = x[:, -1] + delta
        if return_logvar:
            logvar = self.logvar_head(g).transpose(1, 2).reshape(B, C, H, W)
            return out, logvar
        return out


def lat_weights(n_lat, device):
    lat = torch.linspace(90.0, -90.0, n_lat, device=device)
    w = torch.cos(torch.deg2rad(lat))
    return (w / w.mean()).view(1, 1, -1, 1)


def lr_lambda(step, warmup, total):
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


@torch.no_grad()
def evaluate(net, loader, std, w, device):
    net.eval()
    rmse_sum = torch.zeros(len(VARIABLES), dtype=torch.float64, device=device)
    n = torch.zeros(1, dtype=torch.float64, device=device)
    for x, y in loader:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = net(x)
        err = ((pred.float() - y) * std) ** 2
        rmse = (err * w).mean(dim=(-2, -1)).sqrt()
        rmse_sum += rmse.sum(0).double()
        n += rmse.shape[0]
    dist.all_reduce(rmse_sum)
    dist.all_reduce(n)
    net.train()
    return (rmse_sum / n).cpu()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(1234)

    stats = np.load(os.path.join(args.data_dir, "stats.npz"))
    mean, std = stats["mean"].astype(np.float32), stats["std"].astype(np.float32)
    train_ds = ERA5Pairs(args.data_dir, parse_years(args.train_years), mean, std)
    val_full = ERA5Pairs(args.data_dir, parse_years(args.val_years), mean, std)
    val_ds = Subset(val_full, list(range(rank, len(val_full), world)))

    per_gpu = args.global_batch // world
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=per_gpu, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=per_gpu, shuffle=False, num_workers=args.workers,
                        pin_memory=True)

    graph = torch.load(args.graph, map_location="cpu")
    net = MeshForecaster(graph, len(VARIABLES), args.hidden, args.layers).to(device)
    model = DDP(net, device_ids=[local_rank], broadcast_buffers=False)  # buffers are the static graph

    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=args.weight_decay)
    total_steps = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, args.warmup_steps, total_steps))

    start_epoch, best = 0, float("inf")
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]

    w = lat_weights(train_ds.arrays[0].shape[-2], device)
    std_t = torch.from_numpy(std).to(device).view(1, -1, 1, 1)
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        log.info("world=%d per_gpu_batch=%d train=%d val=%d", world, per_gpu,
                 len(train_ds), len(val_full))

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (x, y) in enumerate(train_dl):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if args.loss == "nll":
                    pred, logvar = model(x, return_logvar=True)
                    loss = (0.5 * (logvar + (pred - y) ** 2 * torch.exp(-logvar)) * w).mean()
                else:
                    pred = model(x)
                    loss = ((pred - y) ** 2 * w).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 32.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                log.info("epoch %d step %d/%d loss %.4f lr %.2e %.2fs/it", epoch, step,
                         len(train_dl), loss.item(), sched.get_last_lr()[0],
                         (time.time() - t0) / (step + 1))

        rmse = evaluate(net, val_dl, std_t, w, device)
        score = rmse[VARIABLES.index("z500")].item()
        if rank == 0:
            log.info("epoch %d val " + " ".join(f"{v}={r:.3f}" for v, r in zip(VARIABLES, rmse)),
                     epoch)
            ckpt = {"model": net.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "epoch": epoch, "best": min(best, score),
                    "args": vars(args)}
            torch.save(ckpt, os.path.join(args.out_dir, "last.pt"))
            if score < best:
                torch.save(ckpt, os.path.join(args.out_dir, "best.pt"))
        best = min(best, score)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
