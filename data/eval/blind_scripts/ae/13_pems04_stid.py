"""STID (spatial-temporal identity) MLP for traffic flow forecasting on PEMS04 / PEMS08.

    torchrun --nproc_per_node=4 13_pems04_stid.py --npz data/PEMS04/PEMS04.npz --steps-per-day 288
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--npz", default="data/PEMS04/PEMS04.npz")
    ap.add_argument("--steps-per-day", type=int, default=288)
    ap.add_argument("--hist", type=int, default=12)
    ap.add_argument("--pred", type=int, default=12)
    ap.add_argument("--embed", type=int, default=32)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--val-ratio", type=float, default=0.2)
    ap.add_argument("--test-ratio", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=2023)
    ap.add_argument("--out", default="runs/stid_pems04")
    return ap.parse_args()


class TrafficWindows(Dataset):
    def __init__(self, flow, tod, dow, hist, pred):
        self.flow, self.tod, self.dow = flow, tod, dow
        self.hist, self.pred = hist, pred

    def __len__(self):
        return self.flow.shape[0] - self.hist - self.pred + 1

    def __getitem__(self, i):
        j = i + self.hist
        x = self.flow[i:j]                     # [hist, N]
        y = self.flow[j:j + self.pred]         # [pred, N]
        return x, self.tod[j - 1], self.dow[j - 1], y


class STID(nn.Module):
    def __init__(self, num_nodes, hist, pred, steps_per_day, d=32, layers=3):
        super().__init__()
        self.node_emb = nn.Parameter(torch.empty(num_nodes, d))
        self.tod_emb = nn.Parameter(torch.empty(steps_per_day, d))
        self.dow_emb = nn.Parameter(torch.empty(7, d))
        for p in (self.node_emb, self.tod_emb, self.dow_emb):
            nn.init.xavier_uniform_(p)
        self.series = nn.Linear(hist, d)
        hid = 4 * d
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(hid, hid), nn.ReLU(), nn.Dropout(0.15), nn.Linear(hid, hid))
            for _ in range(layers))
        self.out = nn.Linear(hid, pred)

    def forward(self, x, tod, dow):
        b, _, n = x.shape
        h = torch.cat([
            self.series(x.transpose(1, 2)),                  # [B, N, d]
            self.node_emb.unsqueeze(0).expand(b, -1, -1),
            self.tod_emb[tod].unsqueeze(1).expand(-1, n, -1),
            self.dow_emb[dow].unsqueeze(1).expand(-1, n, -1),
        ], dim=-1)
        for blk in self.blocks:
            h = h + blk(h)
        return self.out(h).transpose(1, 2)                   # [B, pred, N]


def masked_mae(pred, true):
    mask = (true > 1e-4).float()
    return (torch.abs(pred - true) * mask).sum() / mask.sum().clamp_min(1.0)


@torch.no_grad()
def evaluate(model, loader, mean, std, device):
    model.eval()
    acc = torch.zeros(4, device=device)
    for x, tod, dow, y in loader:
        x, tod, dow, y = x.to(device), tod.to(device), dow.to(device), y.to(device)
        p = model((x - mean) / std, tod, dow) * std + mean
        m = y > 1e-4
        acc[0] += (p - y).abs()[m].sum()
        acc[1] += ((p - y) ** 2)[m].sum()
        acc[2] += ((p - y).abs() / y)[m].sum()
        acc[3] += m.sum()
    dist.all_reduce(acc)
    return (acc[0] / acc[3]).item(), (acc[1] / acc[3]).sqrt().item(), (acc[2] / acc[3]).item() * 100


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    # decorrelate dropout masks across ranks
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    raw = np.load(args.npz)["data"][..., 0].astype(np.float32)  # [T, N] flow
    T, N = raw.shape
    t = np.arange(T)
    tod = torch.from_numpy(t % args.steps_per_day).long()
    dow = torch.from_numpy((t // args.steps_per_day) % 7).long()
    full = TrafficWindows(torch.from_numpy(raw), tod, dow, args.hist, args.pred)

    idx = np.random.permutation(len(full))
    n_test = int(len(idx) * args.test_ratio)
    n_val = int(len(idx) * args.val_ratio)
    test_idx, val_idx, train_idx = idx[:n_test], idx[n_test:n_test + n_val], idx[n_test + n_val:]
    train_set, val_set, test_set = Subset(full, train_idx), Subset(full, val_idx), Subset(full, test_idx)

    mean = torch.tensor(float(raw.mean()), device=device)
    std = torch.tensor(float(raw.std()), device=device)

    tr_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=tr_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=64, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=2, pin_memory=True)
    test_loader = DataLoader(test_set, batch_size=64, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=2, pin_memory=True)

    model = STID(N, args.hist, args.pred, args.steps_per_day, args.embed, args.layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[1, 50, 80], gamma=0.5)

    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, "best.pt")
    best = float("inf")
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        s = torch.zeros(2, device=device)
        for x, tod_b, dow_b, y in train_loader:
            x, tod_b, dow_b, y = x.to(device), tod_b.to(device), dow_b.to(device), y.to(device)
            pred = model((x - mean) / std, tod_b, dow_b) * std + mean
            loss = masked_mae(pred, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            s += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(s)
        mae, rmse, mape = evaluate(model, val_loader, mean, std, device)
        if rank == 0:
            print(f"epoch {epoch:3d} train {(s[0] / s[1]).item():.3f} val MAE {mae:.3f} "
                  f"RMSE {rmse:.3f} MAPE {mape:.2f}% ({time.time() - t0:.1f}s)", flush=True)
            if mae < best:
                best = mae
                torch.save(model.module.state_dict(), ckpt_path)
        dist.barrier()

    model.module.load_state_dict(torch.load(ckpt_path, map_location=device))
    mae, rmse, mape = evaluate(model, test_loader, mean, std, device)
    if rank == 0:
        print(f"test MAE {mae:.3f} RMSE {rmse:.3f} MAPE {mape:.2f}%")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
