"""Trajectory-User Linking (TUL) on Gowalla check-ins.

Check-in sequences are split into daily sub-trajectories; the task is to tell
which user produced a sub-trajectory. Users with < 20 sub-trajectories are
dropped. 80/20 split of each user's sub-trajectories (time ordered).

    torchrun --nproc_per_node=4 10_gowalla_tul_trainer.py --config configs/tul_gowalla.yaml
"""
import argparse
import os
import time
from collections import defaultdict

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = dict(
    checkins="data/gowalla/loc-gowalla_totalCheckins.txt",
    out_dir="exp/tul_gowalla",
    min_subtraj=20,
    max_len=32,
    emb_dim=256,
    hidden=512,
    batch_size=64,
    lr=2e-3,
    warmup_epochs=2,
    epochs=60,
    label_smoothing=0.1,
    seed=7,
)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    cfg["resume"] = a.resume
    return argparse.Namespace(**cfg)


def build_subtrajectories(path, min_subtraj, max_len):
    df = pd.read_csv(path, sep="\t", header=None, names=["user", "ts", "lat", "lon", "loc"])
    df["ts"] = pd.to_datetime(df.ts)
    df["day"] = df.ts.dt.floor("D")
    df = df.sort_values(["user", "ts"])
    loc_map = {l: i + 1 for i, l in enumerate(np.sort(df["loc"].unique()))}
    per_user = defaultdict(list)
    for (u, _), g in df.groupby(["user", "day"], sort=True):
        if len(g) >= 2:
            locs = [loc_map[l] for l in g["loc"].values[:max_len]]
            hours = (g.ts.dt.hour.values[:max_len] + 24 * (g.ts.dt.dayofweek.values[:max_len] >= 5)).tolist()
            per_user[u].append((locs, hours))
    users = sorted(u for u, s in per_user.items() if len(s) >= min_subtraj)
    user_map = {u: i for i, u in enumerate(users)}
    train, test = [], []
    for u in users:
        s = per_user[u]
        cut = int(0.8 * len(s))
        train += [(l, h, user_map[u]) for l, h in s[:cut]]
        test += [(l, h, user_map[u]) for l, h in s[cut:]]
    return train, test, len(loc_map) + 1, len(users)


class SubTrajDataset(Dataset):
    def __init__(self, items, max_len):
        self.items, self.max_len = items, max_len

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        locs, hours, u = self.items[i]
        L = len(locs)
        x = torch.zeros(self.max_len, dtype=torch.long)
        h = torch.zeros(self.max_len, dtype=torch.long)
        x[:L] = torch.tensor(locs)
        h[:L] = torch.tensor(hours)
        return x, h, L, u


class TULNet(nn.Module):
    def __init__(self, n_loc, n_user, emb_dim, hidden):
        super().__init__()
        self.loc = nn.Embedding(n_loc, emb_dim, padding_idx=0)
        self.hour = nn.Embedding(48, 32)
        self.rnn = nn.GRU(emb_dim + 32, hidden, batch_first=True, bidirectional=True)
        self.attn = nn.Linear(2 * hidden, 1)
        self.cls = nn.Sequential(nn.Dropout(0.3), nn.Linear(2 * hidden, n_user))

    def forward(self, x, h, lengths):
        out, _ = self.rnn(torch.cat([self.loc(x), self.hour(h)], -1))
        pad = torch.arange(x.size(1), device=x.device)[None] >= lengths[:, None]
        w = self.attn(out).squeeze(-1).masked_fill(pad, -1e4).softmax(-1)
        return self.cls((w[..., None] * out).sum(1))


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        torch.manual_seed(cfg.seed)

        train, test, n_loc, self.n_user = build_subtrajectories(cfg.checkins, cfg.min_subtraj, cfg.max_len)
        self.train_ds = SubTrajDataset(train, cfg.max_len)
        self.test_ds = SubTrajDataset(test, cfg.max_len)
        self.train_sampler = DistributedSampler(self.train_ds, shuffle=True, seed=cfg.seed)
        self.train_dl = DataLoader(self.train_ds, batch_size=cfg.batch_size, sampler=self.train_sampler,
                                   num_workers=4, pin_memory=True, drop_last=True)
        test_idx = list(range(self.rank, len(self.test_ds), self.world))
        self.test_dl = DataLoader(torch.utils.data.Subset(self.test_ds, test_idx), batch_size=512,
                                  num_workers=2, pin_memory=True)

        self.net = TULNet(n_loc, self.n_user, cfg.emb_dim, cfg.hidden).to(self.device)
        self.model = DDP(self.net, device_ids=[self.local_rank])
        # lr is given for a global batch of 256
        lr = cfg.lr * cfg.batch_size * self.world / 256
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=1e-4)
        steps_per_epoch = len(self.train_dl)
        self.sched = torch.optim.lr_scheduler.OneCycleLR(
            self.opt, max_lr=lr, epochs=cfg.epochs, steps_per_epoch=steps_per_epoch,
            pct_start=cfg.warmup_epochs / cfg.epochs)
        self.start_epoch, self.best = 0, 0.0
        self.ckpt_path = os.path.join(cfg.out_dir, "last.pt")
        if cfg.resume and os.path.isfile(self.ckpt_path):
            ck = torch.load(self.ckpt_path, map_location=self.device)
            self.net.load_state_dict(ck["model"])
            self.opt.load_state_dict(ck["opt"])
            self.sched.load_state_dict(ck["sched"])
            self.start_epoch, self.best = ck["epoch"] + 1, ck["best"]
        if self.rank == 0:
            os.makedirs(cfg.out_dir, exist_ok=True)
            print(f"locations={n_loc} users={self.n_user} train={len(self.train_ds)} test={len(self.test_ds)} lr={lr:.2e}")

    def train_epoch(self, epoch):
        self.model.train()
        acc = torch.zeros(2, device=self.device)
        for step, (x, h, L, u) in enumerate(self.train_dl):
            x, h = x.to(self.device, non_blocking=True), h.to(self.device, non_blocking=True)
            L, u = L.to(self.device, non_blocking=True), u.to(self.device, non_blocking=True)
            loss = F.cross_entropy(self.model(x, h, L), u, label_smoothing=self.cfg.label_smoothing)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.sched.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=self.device)])
            if self.rank == 0 and step % 500 == 0:
                print(f"  epoch {epoch} step {step}/{len(self.train_dl)} loss {loss.item():.4f} "
                      f"lr {self.sched.get_last_lr()[0]:.2e}", flush=True)
        dist.all_reduce(acc)
        return (acc[0] / acc[1]).item()

    @torch.no_grad()
    def test(self):
        self.net.eval()
        c = torch.zeros(3, device=self.device)  # hits@1, hits@5, n
        for x, h, L, u in self.test_dl:
            x, h, L, u = x.to(self.device), h.to(self.device), L.to(self.device), u.to(self.device)
            top5 = self.net(x, h, L).topk(5, -1).indices
            c[0] += (top5[:, 0] == u).sum()
            c[1] += (top5 == u[:, None]).any(1).sum()
            c[2] += len(u)
        dist.all_reduce(c)
        self.net.train()
        return (c[0] / c[2]).item(), (c[1] / c[2]).item()

    def fit(self):
        for epoch in range(self.start_epoch, self.cfg.epochs):
            t0 = time.time()
            loss = self.train_epoch(epoch)
            a1, a5 = self.test()
            if self.rank == 0:
                print(f"[{epoch:02d}] loss {loss:.4f} acc@1 {a1:.4f} acc@5 {a5:.4f} {time.time() - t0:.0f}s",
                      flush=True)
                self.best = max(self.best, a1)
                torch.save({"model": self.net.state_dict(), "opt": self.opt.state_dict(),
                            "sched": self.sched.state_dict(), "epoch": epoch, "best": self.best},
                           self.ckpt_path)
            dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    Trainer(load_config()).fit()
