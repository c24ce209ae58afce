"""Account-level AML model: transformer over an account's daily activity (365 days) -> SAR filed within 90 days.

Gradient accumulation (no_sync on the inner micro-steps), activation checkpointing
in the encoder blocks, bf16 autocast, early stopping decided on rank 0 and broadcast.

    torchrun --nproc_per_node=8 12_sar_account_encoder.py --data /shared/aml/daily_seq --accum 4
"""
import argparse
import contextlib
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class DailySeq(Dataset):
    def __init__(self, root, split):
        self.x = np.load(os.path.join(root, f"{split}_x.npy"), mmap_mode="r")  # [N, 365, F] float16
        self.y = np.load(os.path.join(root, f"{split}_y.npy"))
        self.static = np.load(os.path.join(root, f"{split}_static.npy"))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return i, torch.from_numpy(self.x[i].astype(np.float32)), torch.from_numpy(self.static[i]).float(), float(self.y[i])


class Block(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(dropout), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(self.ln2(x))


class AccountEncoder(nn.Module):
    def __init__(self, n_feat, n_static, d=256, depth=6, heads=8, dropout=0.1, patch=7, grad_ckpt=True):
        super().__init__()
        self.patch = patch
        self.embed = nn.Linear(n_feat * patch, d)          # weekly patches
        self.pos = nn.Parameter(torch.zeros(1, 365 // patch + 1, d))
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(depth))
        self.norm = nn.LayerNorm(d)
        self.static = nn.Sequential(nn.Linear(n_static, d), nn.GELU())
        self.head = nn.Linear(2 * d, 1)
        self.grad_ckpt = grad_ckpt
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, x, s):
        b, t, f = x.shape
        t = (t // self.patch) * self.patch
        x = x[:, -t:].reshape(b, t // self.patch, self.patch * f)
        h = torch.cat([self.cls.expand(b, -1, -1), self.embed(x)], dim=1) + self.pos[:, : t // self.patch + 1]
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                h = checkpoint(blk, h, use_reentrant=False)
            else:
                h = blk(h)
        h = self.norm(h[:, 0])
        return self.head(torch.cat([h, self.static(s)], dim=-1)).squeeze(-1)


@torch.no_grad()
def evaluate(model, loader, device, world):
    model.eval()
    rows = []
    for idx, x, s, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logit = model(x.to(device, non_blocking=True), s.to(device, non_blocking=True))
        rows.append(np.stack([idx.numpy(), torch.sigmoid(logit.float()).cpu().numpy(), y.numpy()], 1))
    parts = [None] * world
    dist.all_gather_object(parts, np.concatenate(rows))
    arr = np.concatenate(parts)
    # DistributedSampler pads the last shard with repeated samples; keep each account once
    _, keep = np.unique(arr[:, 0].astype(np.int64), return_index=True)
    arr = arr[keep]
    return float(average_precision_score(arr[:, 2], arr[:, 1])), len(arr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="/shared/aml/runs/acct_enc")
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--patience", type=int, default=3)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    train_ds, val_ds = DailySeq(args.data, "train"), DailySeq(args.data, "val")
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.micro_batch, sampler=train_sampler, num_workers=6,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=256, sampler=val_sampler, num_workers=4, pin_memory=True)

    net = AccountEncoder(train_ds.x.shape[-1], train_ds.static.shape[-1]).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05, betas=(0.9, 0.95))
    updates_per_epoch = len(train_dl) // args.accum
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * updates_per_epoch,
                                                pct_start=0.05)
    pos_frac = float(train_ds.y.mean())
    loss_fn = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(min(100.0, (1 - pos_frac) / pos_frac), device=device))

    ckpt_path = os.path.join(args.out, "last.pt")
    start_epoch, best_ap, bad = 0, 0.0, 0
    if args.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best_ap, bad = ck["epoch"] + 1, ck["best_ap"], ck["bad"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, seen = time.time(), 0
        loss_log = torch.zeros((), device=device)
        it = iter(train_dl)
        for _ in range(updates_per_epoch):
            for micro in range(args.accum):
                _, x, s, y = next(it)
                x, s, y = x.to(device, non_blocking=True), s.to(device, non_blocking=True), y.float().to(device)
                sync = micro == args.accum - 1
                with (contextlib.nullcontext() if sync else model.no_sync()):
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        logit = model(x, s)
                    loss = loss_fn(logit.float(), y) / args.accum
                    loss.backward()
                loss_log += loss.detach()
                seen += y.numel()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
        dist.all_reduce(loss_log, op=dist.ReduceOp.AVG)

        val_ap, n_val = evaluate(model, val_dl, device, world)
        stop = torch.zeros(1, device=device)
        if rank == 0:
            improved = val_ap > best_ap
            best_ap, bad = (val_ap, 0) if improved else (best_ap, bad + 1)
            print(json.dumps({"epoch": epoch, "loss": loss_log.item() / updates_per_epoch, "val_ap": round(val_ap, 5),
                              "n_val": n_val, "lr": sched.get_last_lr()[0], "sec": round(time.time() - t0)}), flush=True)
            state = {"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best_ap": best_ap, "bad": bad}
            torch.save(state, ckpt_path)
            if improved:
                torch.save(state, os.path.join(args.out, "best.pt"))
            stop[0] = float(bad >= args.patience)
        dist.broadcast(stop, src=0)
        if stop.item() > 0:
            if rank == 0:
                print(f"early stopping at epoch {epoch}, best val AP {best_ap:.4f}")
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
