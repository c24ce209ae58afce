"""Flashback-style next-location prediction (Yang et al., IJCAI'20), DDP version.

RNN hidden states of past check-ins are re-weighted by temporal and spatial
distance to the current check-in before the output layer. Works on Gowalla and
Foursquare global check-ins; Foursquare additionally provides venue categories.

    torchrun --nproc_per_node=4 20_flashback_nextloc_gowalla.py --dataset gowalla
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
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

SOURCES = {
    "gowalla": ("loc-gowalla_totalCheckins.txt", ["user", "ts", "lat", "lon", "loc"]),
    "foursquare": ("checkins_global_with_cat.tsv", ["user", "ts", "lat", "lon", "loc", "cat"]),
}


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", choices=list(SOURCES), default="gowalla")
    p.add_argument("--root", default="data/checkins")
    p.add_argument("--out", default="ckpt/flashback")
    p.add_argument("--min_checkins", type=int, default=101)
    p.add_argument("--seq_len", type=int, default=20)
    p.add_argument("--hidden", type=int, default=10)
    p.add_argument("--lambda_t", type=float, default=0.1)
    p.add_argument("--lambda_s", type=float, default=1000.0)
    p.add_argument("--batch_size", type=int, default=200)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--eval_every", type=int, default=5)
    return p.parse_args()


def load(args):
    fname, cols = SOURCES[args.dataset]
    df = pd.read_csv(os.path.join(args.root, fname), sep="\t", header=None, names=cols)
    df["ts"] = pd.to_datetime(df.ts).astype("int64") // 10**9
    counts = df.user.value_counts()
    df = df[df.user.isin(counts[counts >= args.min_checkins].index)].sort_values(["user", "ts"])
    loc_map = {l: i for i, l in enumerate(np.sort(df["loc"].unique()))}
    user_map = {u: i for i, u in enumerate(np.sort(df.user.unique()))}
    df["l"] = df["loc"].map(loc_map)
    df["u"] = df.user.map(user_map)
    n_cat = 0
    if "cat" in df:
        cat_map = {c: i for i, c in enumerate(np.sort(df.cat.unique()))}
        df["c"] = df.cat.map(cat_map)
        n_cat = len(cat_map)
    return df, len(loc_map), len(user_map), n_cat


def make_windows(df, seq_len):
    """Per user: first 80% of the check-ins for training, the rest for test."""
    train, test = [], []
    has_cat = "c" in df
    for u, g in df.groupby("u", sort=True):
        a = {k: g[k].to_numpy() for k in ["l", "ts", "lat", "lon"] + (["c"] if has_cat else [])}
        n = len(g) - 1
        cut = int(0.8 * n)
        for s in range(0, n - seq_len + 1, seq_len):
            w = {k: v[s: s + seq_len + 1] for k, v in a.items()}
            (train if s + seq_len <= cut else test).append((u, w))
    return train, test


class WindowDataset(Dataset):
    def __init__(self, windows):
        self.w = windows

    def __len__(self):
        return len(self.w)

    def __getitem__(self, i):
        u, w = self.w[i]
        out = {
            "user": torch.tensor(u),
            "loc": torch.from_numpy(w["l"][:-1]).long(),
            "t": torch.from_numpy(w["ts"][:-1]).double(),
            "coord": torch.from_numpy(np.stack([w["lat"][:-1], w["lon"][:-1]], 1)).float(),
            "target": torch.from_numpy(w["l"][1:]).long(),
        }
        if "c" in w:
            out["cat"] = torch.from_numpy(w["c"][:-1]).long()
        return out


class Flashback(nn.Module):
    def __init__(self, n_loc, n_user, n_cat, hidden, lambda_t, lambda_s):
        super().__init__()
        self.loc_emb = nn.Embedding(n_loc, hidden)
        self.cat_emb = nn.Embedding(max(n_cat, 1), hidden)
        self.user_emb = nn.Embedding(n_user, hidden)
        self.rnn = nn.RNN(hidden, hidden, batch_first=True)
        self.fc = nn.Linear(2 * hidden, n_loc)
        self.lambda_t, self.lambda_s = lambda_t, lambda_s

    def forward(self, loc, t, coord, user, cat=None):
        x = self.loc_emb(loc)
        if cat is not None:
            x = x + self.cat_emb(cat)
        h, _ = self.rnn(x)  # (B, T, H)
        dt = (t[:, :, None] - t[:, None, :]).float() / 86400.0  # days, (B, T, T)
        ds = torch.cdist(coord, coord)  # degrees, as in the original implementation
        w_t = ((torch.cos(dt * 2 * math.pi) + 1) / 2) * torch.exp(-dt.clamp(min=0) * self.lambda_t)
        w_s = torch.exp(-ds * self.lambda_s)
        causal = torch.ones_like(dt, dtype=torch.bool).tril()
        w = (w_t * w_s + 1e-10).masked_fill(~causal, 0.0)
        out = torch.bmm(w, h) / w.sum(-1, keepdim=True)
        u = self.user_emb(user)[:, None].expand(-1, loc.size(1), -1)
        return self.fc(torch.cat([out, u], -1))


def to_dev(batch, device):
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    s = torch.zeros(5, device=device)  # acc@1, acc@5, acc@10, mrr, n
    for b in loader:
        b = to_dev(b, device)
        logits = net(b["loc"], b["t"], b["coord"], b["user"], b.get("cat"))
        y = b["target"]
        r = (logits > logits.gather(-1, y[..., None])).sum(-1) + 1
        s[0] += (r <= 1).sum()
        s[1] += (r <= 5).sum()
        s[2] += (r <= 10).sum()
        s[3] += (1.0 / r.float()).sum()
        s[4] += y.numel()
    dist.all_reduce(s)
    net.train()
    return {"acc@1": s[0] / s[4], "acc@5": s[1] / s[4], "acc@10": s[2] / s[4], "mrr": s[3] / s[4]}


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    df, n_loc, n_user, n_cat = load(args)
    train_w, test_w = make_windows(df, args.seq_len)
    train_ds, test_ds = WindowDataset(train_w), WindowDataset(test_w)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=42, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    test_dl = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), batch_size=512, num_workers=2)

    net = Flashback(n_loc, n_user, n_cat, args.hidden, args.lambda_t, args.lambda_s).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[20, 40, 60, 80], gamma=0.2)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{args.dataset}: users={n_user} locs={n_loc} cats={n_cat} train={len(train_ds)} test={len(test_ds)}")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for b in train_dl:
            b = to_dev(b, device)
            logits = model(b["loc"], b["t"], b["coord"], b["user"], b.get("cat"))
            loss = F.cross_entropy(logits.flatten(0, 1), b["target"].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} ({time.time() - t0:.0f}s)", flush=True)

        if (epoch + 1) % args.eval_every == 0:
            m = evaluate(net, test_dl, device)
            if rank == 0:
                print("  test " + " ".join(f"{k} {v.item():.4f}" for k, v in m.items()), flush=True)
                torch.save({"model": net.state_dict(), "epoch": epoch, "dataset": args.dataset},
                           os.path.join(args.out, f"{args.dataset}_ep{epoch + 1}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
