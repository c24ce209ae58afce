"""Decoder-only transformer over regional weekly demand, with auto-resume.

The job runs on a preemptible queue: it writes `last.pt` every epoch and picks
up from it automatically when restarted with the same command.

    torchrun --nproc_per_node=8 10_demand_transformer.py --data_dir /nfs/forecast/regional \
        --run_dir /nfs/forecast/runs/regional_tf
"""
import argparse
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="/nfs/forecast/regional")
    p.add_argument("--run_dir", default="/nfs/forecast/runs/regional_tf")
    p.add_argument("--ctx", type=int, default=156)
    p.add_argument("--horizon", type=int, default=26)
    p.add_argument("--origins", type=int, default=4)
    p.add_argument("--d_model", type=int, default=384)
    p.add_argument("--n_layer", type=int, default=6)
    p.add_argument("--n_head", type=int, default=6)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--min_lr", type=float, default=3e-5)
    p.add_argument("--warmup_steps", type=int, default=500)
    p.add_argument("--epochs", type=int, default=50)
    return p.parse_args()


def load(data_dir):
    demand = pd.read_parquet(os.path.join(data_dir, "demand.parquet"))
    wide = demand.pivot(index="region_sku", columns="week", values="units").fillna(0.0)
    return wide.to_numpy(np.float32)


class NextStepWindows(Dataset):
    """Windows of ctx+horizon weeks; the model is trained on next-step prediction."""

    def __init__(self, y, loc, scale, length, end):
        self.y, self.loc, self.scale, self.length = y, loc, scale, length
        self.index = [(s, t) for s in range(len(y)) for t in range(0, end - length + 1)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        s, t = self.index[i]
        w = (np.log1p(self.y[s, t:t + self.length]) - self.loc[s]) / self.scale[s]
        return torch.from_numpy(w.astype(np.float32))


class DemandGPT(nn.Module):
    def __init__(self, max_len, d_model, n_layer, n_head):
        super().__init__()
        self.inp = nn.Linear(1, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_head, 4 * d_model, 0.1, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.blocks = nn.TransformerEncoder(layer, n_layer)
        self.ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, 1)

    def forward(self, x):
        L = x.size(1)
        pos = torch.arange(L, device=x.device)
        h = self.inp(x.unsqueeze(-1)) + self.pos(pos)
        mask = nn.Transformer.generate_square_subsequent_mask(L, device=x.device)
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.out(self.ln(h)).squeeze(-1)

    @torch.no_grad()
    def generate(self, ctx, steps):
        x = ctx
        for _ in range(steps):
            nxt = self(x[:, -self.pos.num_embeddings + 1:])[:, -1:]
            x = torch.cat([x, nxt], 1)
        return x[:, -steps:]


def lr_at(step, total, args):
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    r = (step - args.warmup_steps) / max(1, total - args.warmup_steps)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(r, 1.0)))


@torch.no_grad()
def rolling_backtest(net, y, loc, scale, args, rank, world, device):
    net.eval()
    n, T = y.shape
    acc = torch.zeros(2, dtype=torch.float64, device=device)
    rows = np.arange(rank, n, world)
    for k in range(args.origins, 0, -1):
        cut = T - k * args.horizon
        for b in range(0, len(rows), 2048):
            r = rows[b:b + 2048]
            ctx = (np.log1p(y[r, cut - args.ctx:cut]) - loc[r, None]) / scale[r, None]
            z = net.generate(torch.from_numpy(ctx.astype(np.float32)).to(device), args.horizon)
            pred = np.expm1(z.cpu().numpy() * scale[r, None] + loc[r, None]).clip(0)
            true = y[r, cut:cut + args.horizon]
            acc[0] += float(np.abs(pred - true).sum())
            acc[1] += float(true.sum())
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(11)

    y = load(args.data_dir)
    T = y.shape[1]
    train_end = T - args.origins * args.horizon
    ly = np.log1p(y[:, :train_end])
    loc, scale = ly.mean(1), ly.std(1) + 0.1
    ds = NextStepWindows(y, loc, scale, args.ctx + args.horizon, train_end)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    model = DemandGPT(args.ctx + args.horizon, args.d_model, args.n_layer, args.n_head).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total_steps = args.epochs * len(loader)

    start_epoch, step, best = 0, 0, float("inf")
    last_path = os.path.join(args.run_dir, "last.pt")
    if os.path.exists(last_path):
        ckpt = torch.load(last_path)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        start_epoch, step, best = ckpt["epoch"] + 1, ckpt["step"], ckpt["best"]
        if rank == 0:
            print(f"resumed from epoch {ckpt['epoch']} (step {step})", flush=True)
        del ckpt
    model = DDP(model, device_ids=[local_rank])

    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for w in loader:
            w = w.to(device, non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, total_steps, args)
            pred = model(w[:, :-1])
            loss = F.mse_loss(pred, w[:, 1:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        wape = rolling_backtest(model.module, y, loc, scale, args, rank, world, device)
        best = min(best, wape)
        if rank == 0:
            print(f"epoch {epoch} step {step} loss {(tot[0] / tot[1]).item():.4f} wape {wape:.4f} "
                  f"best {best:.4f} {time.time() - t0:.0f}s", flush=True)
            state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                     "epoch": epoch, "step": step, "best": best, "args": vars(args)}
            torch.save(state, last_path + ".part")
            os.replace(last_path + ".part", last_path)
            if wape <= best:
                torch.save(state["model"], os.path.join(args.run_dir, "best_model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
