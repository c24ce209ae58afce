"""Shifted-window transformer on 1.0 deg ERA5 with a rollout loss, plus a per-init-date
scorecard (lat-weighted RMSE for each 00/12 UTC initialisation of the validation year).

    torchrun --nproc_per_node=8 11_swin_scorecard.py --root /data/era5_1deg --run swin_r4
"""
import argparse
import csv
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

SCORE_CH = {"z500": 7, "t850": 20, "q700": 32, "u850": 46, "t2m": 66, "msl": 68}


class Era5Years(Dataset):
    """Yearly arrays (T, C, 180, 360), 6-hourly. Returns the init state and `steps` targets."""

    def __init__(self, root, years, steps, mean, std, init_hours=(0, 6, 12, 18)):
        self.arrs, self.items = [], []
        for y in years:
            a = np.load(os.path.join(root, f"era5_{y}.npy"), mmap_mode="r")
            times = pd.date_range(f"{y}-01-01", periods=a.shape[0], freq="6h")
            k = len(self.arrs)
            self.arrs.append(a)
            for t in range(a.shape[0] - steps):
                if times[t].hour in init_hours:
                    self.items.append((k, t, int(times[t].value // 10**9)))
        self.steps = steps
        self.mean, self.std = mean[:, None, None], std[:, None, None]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        k, t, stamp = self.items[i]
        seq = (np.asarray(self.arrs[k][t:t + self.steps + 1], dtype=np.float32) - self.mean) / self.std
        return torch.from_numpy(seq), stamp


def window_partition(x, ws):
    B, H, W, C = x.shape
    x = x.view(B, H // ws, ws, W // ws, ws, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, ws * ws, C)


def window_reverse(x, ws, B, H, W):
    C = x.shape[-1]
    x = x.view(B, H // ws, W // ws, ws, ws, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(B, H, W, C)


class SwinBlock(nn.Module):
    def __init__(self, dim, heads, ws, shift):
        super().__init__()
        self.ws, self.shift, self.heads = ws, shift, heads
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        B, H, W, C = x.shape
        h = self.n1(x)
        if self.shift:
            # cyclic shift as in Swin; longitude is periodic anyway
            h = torch.roll(h, (-self.shift, -self.shift), dims=(1, 2))
        win = window_partition(h, self.ws)
        q, k, v = self.qkv(win).view(win.shape[0], -1, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(win.shape[0], -1, C)
        h = window_reverse(self.proj(a), self.ws, B, H, W)
        if self.shift:
            h = torch.roll(h, (self.shift, self.shift), dims=(1, 2))
        x = x + h
        return x + self.mlp(self.n2(x))


class SwinForecaster(nn.Module):
    def __init__(self, ch, dim=512, depth=12, heads=16, patch=4, ws=9):
        super().__init__()
        self.patch = patch
        self.embed = nn.Conv2d(ch, dim, patch, patch)
        self.blocks = nn.ModuleList(SwinBlock(dim, heads, ws, (ws // 2) if i % 2 else 0) for i in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, ch * patch * patch)

    def forward(self, x):
        B, C, H, W = x.shape
        h = self.embed(x).permute(0, 2, 3, 1)          # (B, 45, 90, D)
        for blk in self.blocks:
            h = blk(h)
        h = self.head(self.norm(h))
        gh, gw = h.shape[1], h.shape[2]
        h = h.view(B, gh, gw, C, self.patch, self.patch).permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)
        return x + h


def lat_weights(device):
    lat = torch.arange(89.5, -90.0, -1.0, device=device)
    w = torch.cos(torch.deg2rad(lat))
    return (w / w.mean()).view(1, 1, -1, 1)


@torch.no_grad()
def scorecard(net, loader, w, std, steps, device, rank, world):
    net.eval()
    rows, stamps = [], []
    chans = list(SCORE_CH.values())
    for seq, stamp in loader:
        seq = seq.to(device)
        x = seq[:, 0]
        per_step = []
        for k in range(steps):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                x = net(x).float()
            se = (((x - seq[:, k + 1]) * std) ** 2 * w).mean(dim=(-2, -1)).sqrt()
            per_step.append(se[:, chans])
        rows.append(torch.stack(per_step, dim=1))     # (b, steps, n_score)
        stamps.append(stamp.to(device))
    local = torch.cat(rows)
    local_t = torch.cat(stamps)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    gathered_t = [torch.zeros_like(local_t) for _ in range(world)]
    dist.all_gather(gathered, local)
    dist.all_gather(gathered_t, local_t)
    net.train()
    return torch.cat(gathered).cpu(), torch.cat(gathered_t).cpu()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--runs-dir", default="/data/runs")
    ap.add_argument("--steps", type=int, default=4, help="rollout length in the loss")
    ap.add_argument("--eval-steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4, help="per GPU")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=20)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    out = os.path.join(args.runs_dir, args.run)

    norm = np.load(os.path.join(args.root, "norm_1979_2015.npz"))
    mean, std = norm["mean"].astype(np.float32), norm["std"].astype(np.float32)
    train_ds = Era5Years(args.root, range(1979, 2016), args.steps, mean, std)
    val_full = Era5Years(args.root, [2016], args.eval_steps, mean, std, init_hours=(0, 12))
    val_ds = Subset(val_full, range(rank, len(val_full), world))

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch, num_workers=4, pin_memory=True)

    # 180x360 with patch 4 -> 45x90 tokens, which 9x9 windows tile exactly
    net = SwinForecaster(len(mean)).to(device)
    model = DDP(net, device_ids=[local_rank])
    lr = args.lr * world * args.batch / 32
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.epochs * len(train_dl),
                                                pct_start=0.03, anneal_strategy="cos")
    w = lat_weights(device)
    std_t = torch.from_numpy(std).to(device).view(1, -1, 1, 1)

    if rank == 0:
        os.makedirs(out, exist_ok=True)
        print(f"train samples {len(train_ds)}, val inits {len(val_full)}, world {world}, lr {lr:.2e}")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (seq, _) in enumerate(train_dl):
            seq = seq.to(device, non_blocking=True)
            x, loss = seq[:, 0], 0.0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                for k in range(args.steps):
                    x = model(x)
                    loss = loss + ((x.float() - seq[:, k + 1]) ** 2 * w).mean()
            loss = loss / args.steps
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} it {i} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)

        card, stamps = scorecard(net, val_dl, w, std_t, args.eval_steps, device, rank, world)
        if rank == 0:
            mean_card = card.mean(0)
            names = list(SCORE_CH)
            print(f"epoch {epoch}: " + " ".join(
                f"{n}@{6 * args.eval_steps}h={mean_card[-1, j]:.2f}" for j, n in enumerate(names)), flush=True)
            with open(os.path.join(out, f"scorecard_ep{epoch:02d}.csv"), "w", newline="") as f:
                wr = csv.writer(f)
                wr.writerow(["init", "lead_h"] + names)
                order = torch.argsort(stamps)
                for r in order.tolist():
                    init = pd.Timestamp(int(stamps[r]), unit="s").isoformat()
                    for k in range(args.eval_steps):
                        wr.writerow([init, 6 * (k + 1)] + [f"{v:.4f}" for v in card[r, k].tolist()])
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(out, "model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
