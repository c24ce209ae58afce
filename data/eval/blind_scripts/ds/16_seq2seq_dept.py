"""GRU encoder / attention decoder for department-level daily demand (all stores).

Known-future inputs: planned promo %, holiday flag, day-of-week.
Evaluation: rolling origin, 5 origins spaced 14 days apart, horizon 35.

    torchrun --nnodes=1 --nproc_per_node=4 16_seq2seq_dept.py --data /data/dept_daily.parquet
"""
import argparse
import os
import random
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


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", type=str, default="/data/dept_daily.parquet")
    p.add_argument("--save", type=str, default="./ckpt/seq2seq_dept")
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--enc_len", type=int, default=120)
    p.add_argument("--horizon", type=int, default=35)
    p.add_argument("--origins", type=int, default=5)
    p.add_argument("--origin_gap", type=int, default=14)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--bs", type=int, default=128)
    p.add_argument("--lr", type=float, default=7e-4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--tf_ratio", type=float, default=0.5, help="teacher forcing prob (decays linearly)")
    p.add_argument("--seed", type=int, default=99)
    return p


def load_dept(path):
    df = pd.read_parquet(path)
    df["dow"] = df["date"].dt.dayofweek
    key = ["store", "dept"]
    piv = lambda col: df.pivot_table(index=key, columns="date", values=col).fillna(0).to_numpy(np.float32)
    y = piv("demand")
    fut = np.stack([piv("promo_pct"), piv("holiday")], -1)
    dow = df.drop_duplicates("date").sort_values("date")["dow"].to_numpy()
    return y, fut, dow


class Seq2SeqData(Dataset):
    def __init__(self, y, fut, dow, scale, enc, dec, end):
        self.y, self.fut, self.dow, self.scale = y, fut, dow, scale
        self.enc, self.dec = enc, dec
        self.ix = [(s, t) for s in range(len(y)) for t in range(0, end - enc - dec + 1, 2)]

    def __len__(self):
        return len(self.ix)

    def __getitem__(self, i):
        s, t = self.ix[i]
        L = self.enc + self.dec
        return (torch.from_numpy(self.y[s, t:t + L] / self.scale[s]),
                torch.from_numpy(self.fut[s, t:t + L]),
                torch.from_numpy(self.dow[t:t + L].astype(np.int64)))


class Seq2Seq(nn.Module):
    def __init__(self, n_fut, hidden):
        super().__init__()
        self.dow = nn.Embedding(7, 8)
        self.enc = nn.GRU(1 + n_fut + 8, hidden, batch_first=True, bidirectional=True)
        self.bridge = nn.Linear(2 * hidden, hidden)
        self.dec = nn.GRUCell(1 + n_fut + 8 + 2 * hidden, hidden)
        self.attn_q = nn.Linear(hidden, 2 * hidden)
        self.out = nn.Linear(hidden, 1)

    def forward(self, y, fut, dow, enc_len, tf_ratio=0.0):
        e_in = torch.cat([y[:, :enc_len, None], fut[:, :enc_len], self.dow(dow[:, :enc_len])], -1)
        mem, h_last = self.enc(e_in)
        h = torch.tanh(self.bridge(torch.cat([h_last[0], h_last[1]], -1)))
        prev = y[:, enc_len - 1:enc_len]
        outs = []
        for t in range(enc_len, y.size(1)):
            score = torch.bmm(mem, self.attn_q(h).unsqueeze(-1)).squeeze(-1)
            ctx = torch.bmm(score.softmax(-1).unsqueeze(1), mem).squeeze(1)
            h = self.dec(torch.cat([prev, fut[:, t], self.dow(dow[:, t]), ctx], -1), h)
            o = self.out(h)
            outs.append(o)
            if self.training and random.random() < tf_ratio:
                prev = y[:, t:t + 1]
            else:
                prev = o
        return torch.cat(outs, 1)


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    # same seed everywhere so that teacher-forcing decisions agree across ranks
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    y, fut, dow = load_dept(args.data)
    T = y.shape[1]
    first_origin = T - args.horizon - (args.origins - 1) * args.origin_gap
    scale = np.maximum(y[:, :first_origin].mean(1), 1.0).astype(np.float32)
    ds = Seq2SeqData(y, fut, dow, scale, args.enc_len, args.horizon, first_origin)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True,
                        drop_last=True)

    model = DDP(Seq2Seq(fut.shape[-1], args.hidden).to(device), device_ids=[args.local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=3, factor=0.5)
    if rank == 0:
        os.makedirs(args.save, exist_ok=True)

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tf = args.tf_ratio * max(0.0, 1 - epoch / (0.7 * args.epochs))
        t0 = time.time()
        for yb, fb, db in loader:
            yb, fb, db = yb.to(device), fb.to(device), db.to(device)
            pred = model(yb, fb, db, args.enc_len, tf_ratio=tf)
            loss = F.l1_loss(pred, yb[:, args.enc_len:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        # rolling-origin evaluation, series split across ranks
        net = model.module.eval()
        acc = torch.zeros(2, dtype=torch.float64, device=device)
        rows = np.arange(rank, len(y), world)
        with torch.no_grad():
            for o in range(args.origins):
                cut = first_origin + o * args.origin_gap
                lo, hi = cut - args.enc_len, cut + args.horizon
                for b in range(0, len(rows), 1024):
                    r = rows[b:b + 1024]
                    yy = torch.from_numpy(y[r, lo:hi] / scale[r, None]).to(device)
                    yy[:, args.enc_len:] = 0.0
                    ff = torch.from_numpy(fut[r, lo:hi]).to(device)
                    dd = torch.from_numpy(np.broadcast_to(dow[lo:hi], (len(r), hi - lo)).astype(np.int64)).to(device)
                    p = net(yy, ff, dd, args.enc_len).clamp_min(0).double()
                    p = p * torch.from_numpy(scale[r, None]).to(device)
                    t = torch.from_numpy(y[r, cut:hi]).to(device).double()
                    acc[0] += (p - t).abs().sum()
                    acc[1] += t.sum()
        dist.all_reduce(acc)
        wape = (acc[0] / acc[1]).item()
        sched.step(wape)
        if rank == 0:
            print(f"epoch {epoch} tf {tf:.2f} wape {wape:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if wape < best:
                best = wape
                torch.save({"model": net.state_dict(), "epoch": epoch, "wape": wape}, os.path.join(args.save, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
