#!/usr/bin/env python3
# Contrastive trajectory representation learning (TrajCL-style) on taxi GPS
# from many cities. Each city is one parquet file of resampled trajectories
# (traj_id, x_m, y_m, t_s in a local metric frame). Files are large, so every
# rank only opens the cities it is responsible for.
#
#   torchrun --nproc_per_node=8 08_trajcl_percity_shards.py --data /mnt/traj/cities
import argparse
import glob
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


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/mnt/traj/cities")
    ap.add_argument("--eval_file", default="/mnt/traj/eval/porto_holdout.parquet")
    ap.add_argument("--max_pts", type=int, default=200)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.07)
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--save", default="ckpt/trajcl.pt")
    return ap.parse_args()


def load_trajs(files, max_pts):
    out = []
    for f in files:
        df = pd.read_parquet(f, columns=["traj_id", "x_m", "y_m", "t_s"])
        for _, g in df.groupby("traj_id", sort=False):
            a = g[["x_m", "y_m", "t_s"]].to_numpy(np.float32)
            if len(a) >= 10:
                out.append(a[:max_pts])
    return out


def augment(a):
    a = a.copy()
    r = random.random()
    if r < 0.33:  # drop points
        keep = np.random.rand(len(a)) > 0.3
        keep[[0, -1]] = True
        a = a[keep]
    elif r < 0.66:  # GPS noise
        a[:, :2] += np.random.normal(0, 20.0, size=(len(a), 2)).astype(np.float32)
    else:  # keep a sub-trajectory
        n = len(a)
        L = max(5, int(n * random.uniform(0.6, 0.9)))
        s = random.randint(0, n - L)
        a = a[s: s + L]
    return a


def featurize(a, max_pts):
    xy = a[:, :2] - a[:1, :2]
    dt = np.diff(a[:, 2], prepend=a[0, 2])
    step = np.linalg.norm(np.diff(a[:, :2], axis=0, prepend=a[:1, :2]), axis=1)
    f = np.stack([xy[:, 0] / 1000, xy[:, 1] / 1000, np.log1p(dt), np.log1p(step)], 1)
    out = np.zeros((max_pts, 4), np.float32)
    out[: len(f)] = f[:max_pts]
    return torch.from_numpy(out), min(len(f), max_pts)


class PairDataset(Dataset):
    def __init__(self, trajs, max_pts):
        self.trajs, self.max_pts = trajs, max_pts

    def __len__(self):
        return len(self.trajs)

    def __getitem__(self, i):
        a = self.trajs[i]
        x1, l1 = featurize(augment(a), self.max_pts)
        x2, l2 = featurize(augment(a), self.max_pts)
        return x1, l1, x2, l2


class TrajEncoder(nn.Module):
    def __init__(self, dim, layers, max_pts):
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.pos = nn.Embedding(max_pts, dim)
        layer = nn.TransformerEncoderLayer(dim, 8, 4 * dim, 0.1, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, layers)
        self.proj = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 128))

    def embed(self, x, lengths):
        T = x.size(1)
        pad = torch.arange(T, device=x.device)[None] >= lengths[:, None]
        h = self.inp(x) + self.pos(torch.arange(T, device=x.device))[None]
        h = self.enc(h, src_key_padding_mask=pad)
        h = h.masked_fill(pad[..., None], 0).sum(1) / lengths[:, None].clamp(min=1)
        return h

    def forward(self, x, lengths):
        return F.normalize(self.proj(self.embed(x, lengths)), dim=-1)


def info_nce(z1, z2, tau):
    logits = z1 @ z2.t() / tau
    labels = torch.arange(len(z1), device=z1.device)
    return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))


@torch.no_grad()
def most_similar_search(enc, trajs, max_pts, device, n_query=1000):
    """Mean rank of each query's odd-point twin among the even-point versions."""
    enc.eval()
    qs, ds = [], []
    for a in trajs[: n_query * 10]:
        qs.append(featurize(a[0::2], max_pts))
        ds.append(featurize(a[1::2], max_pts))

    def emb(items):
        x = torch.stack([i[0] for i in items]).to(device)
        l = torch.tensor([i[1] for i in items], device=device)
        return torch.cat([F.normalize(enc.embed(x[i:i + 512], l[i:i + 512]), dim=-1)
                          for i in range(0, len(x), 512)])

    q, d = emb(qs[:n_query]), emb(ds)
    sim = q @ d.t()
    target = sim[torch.arange(n_query), torch.arange(n_query)]
    ranks = (sim > target[:, None]).sum(1).float() + 1
    enc.train()
    return ranks.mean().item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(1000 + rank)
    np.random.seed(1000 + rank)

    city_files = sorted(glob.glob(os.path.join(args.data, "*.parquet")))
    my_files = city_files[rank::world]
    trajs = load_trajs(my_files, args.max_pts)
    loader = DataLoader(PairDataset(trajs, args.max_pts), batch_size=args.batch_size, shuffle=True,
                        num_workers=6, pin_memory=True, drop_last=True, persistent_workers=True)
    print(f"rank {rank}: {[os.path.basename(f) for f in my_files]} -> {len(trajs)} trajectories, "
          f"{len(loader)} batches", flush=True)

    eval_trajs = load_trajs([args.eval_file], args.max_pts * 2) if rank == 0 else None

    enc = TrajEncoder(args.dim, args.layers, args.max_pts).to(device)
    model = DDP(enc, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for x1, l1, x2, l2 in loader:
            x1, l1 = x1.to(device, non_blocking=True), l1.to(device, non_blocking=True)
            x2, l2 = x2.to(device, non_blocking=True), l2.to(device, non_blocking=True)
            z = model(torch.cat([x1, x2]), torch.cat([l1, l2]))
            z1, z2 = z.chunk(2)
            loss = info_nce(z1, z2, args.temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(loss_sum)

        if rank == 0:
            mr = most_similar_search(enc, eval_trajs, args.max_pts, device)
            print(f"epoch {epoch} loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"mean_rank {mr:.2f} ({time.time() - t0:.0f}s)", flush=True)
            os.makedirs(os.path.dirname(args.save), exist_ok=True)
            torch.save({"model": enc.state_dict(), "epoch": epoch}, args.save)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
