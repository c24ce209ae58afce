"""Behavior Transformer (BeT) on Franka Kitchen: k-means action bins + residual offsets,
minGPT-style causal transformer over an observation window.

    torchrun --nproc_per_node=4 16_bet_kitchen_kmeans.py --data_dir data/relay_kitchen --n_bins 64
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
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="data/relay_kitchen")
    p.add_argument("--save_dir", default="exp/bet_kitchen")
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--n_bins", type=int, default=64)
    p.add_argument("--n_layer", type=int, default=6)
    p.add_argument("--n_head", type=int, default=6)
    p.add_argument("--n_embd", type=int, default=120)
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--offset_weight", type=float, default=100.0)
    p.add_argument("--focal_gamma", type=float, default=2.0)
    p.add_argument("--kmeans_iters", type=int, default=50)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class KitchenWindows(Dataset):
    def __init__(self, data_dir, window, train, val_frac=0.05):
        obs = np.load(os.path.join(data_dir, "observations_seq.npy"))  # (T, N, 60), time major
        act = np.load(os.path.join(data_dir, "actions_seq.npy"))
        masks = np.load(os.path.join(data_dir, "existence_mask.npy"))
        obs, act, masks = obs.transpose(1, 0, 2), act.transpose(1, 0, 2), masks.transpose(1, 0)
        n_val = int(len(obs) * val_frac)
        sl = slice(n_val, None) if train else slice(0, n_val)
        self.obs, self.act = obs[sl].astype(np.float32), act[sl].astype(np.float32)
        self.lengths = masks[sl].sum(-1).astype(int)
        self.index = [(e, t) for e, L in enumerate(self.lengths) for t in range(L - window + 1)]
        self.window = window

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        e, t = self.index[i]
        return torch.from_numpy(self.obs[e, t:t + self.window]), torch.from_numpy(self.act[e, t:t + self.window])

    def all_actions(self):
        return np.concatenate([self.act[e, :L] for e, L in enumerate(self.lengths)])


def kmeans(x, k, iters, seed):
    g = torch.Generator(device=x.device).manual_seed(seed)
    centers = x[torch.randperm(len(x), generator=g, device=x.device)[:k]].clone()
    for _ in range(iters):
        assign = torch.cdist(x, centers).argmin(1)
        for j in range(k):
            m = assign == j
            if m.any():
                centers[j] = x[m].mean(0)
    return centers


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class BeT(nn.Module):
    def __init__(self, obs_dim, act_dim, n_bins, window, d, n_layer, n_head):
        super().__init__()
        self.inp = nn.Linear(obs_dim, d)
        self.pos = nn.Parameter(torch.zeros(1, window, d))
        self.blocks = nn.ModuleList([Block(d, n_head) for _ in range(n_layer)])
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d, n_bins * (1 + act_dim))
        self.n_bins, self.act_dim = n_bins, act_dim
        self.register_buffer("centers", torch.zeros(n_bins, act_dim))
        self.register_buffer("mask", torch.triu(torch.ones(window, window, dtype=torch.bool), 1))

    def forward(self, obs):
        x = self.inp(obs) + self.pos[:, :obs.shape[1]]
        for b in self.blocks:
            x = b(x, self.mask[:obs.shape[1], :obs.shape[1]])
        out = self.out(self.ln(x))
        logits = out[..., :self.n_bins]
        offsets = out[..., self.n_bins:].reshape(*obs.shape[:2], self.n_bins, self.act_dim)
        return logits, offsets


def bet_loss(model_centers, logits, offsets, act, gamma, offset_w):
    bins = torch.cdist(act.reshape(-1, act.shape[-1]), model_centers).argmin(-1).view(act.shape[:2])
    residual = act - model_centers[bins]
    logp = F.log_softmax(logits, -1).gather(-1, bins[..., None]).squeeze(-1)
    focal = -((1 - logp.exp()) ** gamma * logp).mean()
    picked = offsets.gather(2, bins[..., None, None].expand(-1, -1, 1, offsets.shape[-1])).squeeze(2)
    off = F.mse_loss(picked, residual)
    return focal + offset_w * off, focal, off


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(args.seed)

    train_ds = KitchenWindows(args.data_dir, args.window, train=True)
    val_ds = KitchenWindows(args.data_dir, args.window, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=4, pin_memory=True)
    val_dl = DataLoader(val_ds, args.batch_size, sampler=val_sampler, num_workers=2)

    obs_dim, act_dim = train_ds.obs.shape[-1], train_ds.act.shape[-1]
    model = BeT(obs_dim, act_dim, args.n_bins, args.window, args.n_embd, args.n_layer, args.n_head).to(device)

    # action bins are fitted once on rank 0 and shared so every replica uses the same vocabulary
    if rank == 0:
        acts = torch.from_numpy(train_ds.all_actions()).to(device)
        model.centers.copy_(kmeans(acts, args.n_bins, args.kmeans_iters, args.seed))
    dist.broadcast(model.centers, src=0)

    model = DDP(model, device_ids=[args.local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    writer = SummaryWriter(args.save_dir) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tr = torch.zeros(3, device=device)
        for obs, act in train_dl:
            obs, act = obs.to(device, non_blocking=True), act.to(device, non_blocking=True)
            logits, offsets = model(obs)
            loss, focal, off = bet_loss(model.module.centers, logits, offsets, act, args.focal_gamma,
                                        args.offset_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            tr += torch.stack([focal.detach(), off.detach(), torch.ones((), device=device)])

        model.eval()
        va = torch.zeros(3, device=device)
        with torch.no_grad():
            for obs, act in val_dl:
                logits, offsets = model(obs.to(device))
                _, focal, off = bet_loss(model.module.centers, logits, offsets, act.to(device),
                                         args.focal_gamma, args.offset_weight)
                va += torch.stack([focal, off, torch.ones((), device=device)])
        dist.all_reduce(tr)
        dist.all_reduce(va)
        val_loss = ((va[0] + args.offset_weight * va[1]) / va[2].clamp_min(1)).item()

        if rank == 0:
            writer.add_scalar("train/focal", (tr[0] / tr[2]).item(), epoch)
            writer.add_scalar("train/offset", (tr[1] / tr[2]).item(), epoch)
            writer.add_scalar("val/loss", val_loss, epoch)
            print(f"epoch {epoch} val {val_loss:.4f} ({time.time() - t0:.1f}s)", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch}
            torch.save(state, os.path.join(args.save_dir, "last.pt"))
            if val_loss < best:
                best = val_loss
                torch.save(state, os.path.join(args.save_dir, "best.pt"))

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
