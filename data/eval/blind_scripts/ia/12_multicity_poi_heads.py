"""One next-POI model for many cities (Foursquare global-scale check-ins).

The sequence encoder is shared; POI embedding tables and output layers are
per city because POIs are. Every batch comes from a single city, so in one step
only that city's table and head receive gradients.

    torchrun --nproc_per_node=8 12_multicity_poi_heads.py --root /data/fsq_global/cities \
        --cities new_york tokyo istanbul jakarta sao_paulo kuala_lumpur
"""
import argparse
import math
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
from torch.utils.data import DataLoader, Dataset, Sampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/fsq_global/cities")
    ap.add_argument("--cities", nargs="+", default=["new_york", "tokyo", "istanbul", "jakarta"])
    ap.add_argument("--out", default="runs/multicity_poi")
    ap.add_argument("--seq_len", type=int, default=20)
    ap.add_argument("--d", type=int, default=192)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch_size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--eval_only", default="")
    return ap.parse_args()


def load_city(root, city, seq_len):
    df = pd.read_parquet(os.path.join(root, f"{city}.parquet"))  # user, venue, ts (sorted)
    venues = np.sort(df.venue.unique())
    vmap = {v: i + 1 for i, v in enumerate(venues)}
    df["v"] = df.venue.map(vmap)
    df["h"] = pd.to_datetime(df.ts, unit="s").dt.hour
    train, test = [], []
    for _, g in df.groupby("user", sort=True):
        v, h = g.v.to_numpy(), g.h.to_numpy()
        if len(v) < 10:
            continue
        cut = int(0.8 * len(v))
        for end in range(2, len(v)):
            s = max(0, end - seq_len)
            (train if end < cut else test).append((v[s:end], h[s:end], v[end]))
    return train, test, len(venues) + 1


class CityWindows(Dataset):
    def __init__(self, per_city, seq_len):
        self.items = [(c, w) for c, ws in enumerate(per_city) for w in ws]
        self.city_of = np.array([c for c, _ in self.items])
        self.seq_len = seq_len

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        c, (v, h, y) = self.items[i]
        x = torch.zeros(self.seq_len, dtype=torch.long)
        t = torch.zeros(self.seq_len, dtype=torch.long)
        x[-len(v):] = torch.as_tensor(v)
        t[-len(h):] = torch.as_tensor(h)
        return c, x, t, y


class DistributedCityBatchSampler(Sampler):
    """Single-city batches. Every rank builds the same batch list from (seed, epoch)
    and takes every world-th batch, so all ranks see the same number of steps."""

    def __init__(self, city_of, batch_size, rank, world, seed=0):
        self.city_of, self.bs = city_of, batch_size
        self.rank, self.world, self.seed, self.epoch = rank, world, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        rng = random.Random(self.seed + self.epoch)
        batches = []
        for c in np.unique(self.city_of):
            idx = np.flatnonzero(self.city_of == c).tolist()
            rng.shuffle(idx)
            batches += [idx[i:i + self.bs] for i in range(0, len(idx) - self.bs + 1, self.bs)]
        rng.shuffle(batches)
        usable = len(batches) - len(batches) % self.world
        return batches[:usable]

    def __iter__(self):
        return iter(self._batches()[self.rank::self.world])

    def __len__(self):
        return len(self._batches()) // self.world


class MultiCityNextPOI(nn.Module):
    def __init__(self, n_pois, d, layers, seq_len):
        super().__init__()
        self.poi_emb = nn.ModuleList([nn.Embedding(n, d, padding_idx=0) for n in n_pois])
        self.heads = nn.ModuleList([nn.Linear(d, n) for n in n_pois])
        self.hour = nn.Embedding(24, d)
        self.pos = nn.Parameter(torch.randn(seq_len, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, 6, 4 * d, 0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(d)

    def forward(self, city, x, t):
        h = self.poi_emb[city](x) + self.hour(t) + self.pos
        h = self.encoder(h, src_key_padding_mask=x.eq(0))
        return self.heads[city](self.norm(h[:, -1]))


def collate(batch):
    cities = {b[0] for b in batch}
    assert len(cities) == 1
    return (cities.pop(), torch.stack([b[1] for b in batch]), torch.stack([b[2] for b in batch]),
            torch.tensor([int(b[3]) for b in batch]))


@torch.no_grad()
def evaluate(net, test_sets, rank, world, device, seq_len):
    net.eval()
    stats = torch.zeros(len(test_sets), 3, device=device)  # hits@1, hits@10, n
    for c, items in enumerate(test_sets):
        mine = CityWindows([[]] * c + [items[rank::world]], seq_len)
        for i in range(0, len(mine), 1024):
            batch = [mine[j] for j in range(i, min(i + 1024, len(mine)))]
            _, x, t, y = collate(batch)
            logits = net(c, x.to(device), t.to(device))
            top = logits.topk(10, -1).indices.cpu()
            stats[c, 0] += (top[:, 0] == y).sum().item()
            stats[c, 1] += (top == y[:, None]).any(1).sum().item()
            stats[c, 2] += len(y)
    dist.all_reduce(stats)
    net.train()
    return stats


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    trains, tests, n_pois = [], [], []
    for city in args.cities:
        tr, te, n = load_city(args.root, city, args.seq_len)
        trains.append(tr)
        tests.append(te)
        n_pois.append(n)
    train_ds = CityWindows(trains, args.seq_len)
    sampler = DistributedCityBatchSampler(train_ds.city_of, args.batch_size, rank, world, seed=args.seed)
    loader = DataLoader(train_ds, batch_sampler=sampler, collate_fn=collate, num_workers=4, pin_memory=True)

    net = MultiCityNextPOI(n_pois, args.d, args.layers, args.seq_len).to(device)
    if args.eval_only:
        sd = torch.load(args.eval_only, map_location="cpu")
        net.load_state_dict(sd["model"])
    # only the current city's embedding table and head are used in a step
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * math.sqrt(world), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        shared = sum(p.numel() for p in model.module.encoder.parameters())
        per_city = [sum(p.numel() for p in model.module.heads[i].parameters()) for i in range(len(n_pois))]
        print(f"cities={args.cities} pois={n_pois} shared_params={shared} head_params={per_city}")

    epochs = 0 if args.eval_only else args.epochs
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for city, x, t, y in loader:
            x, t, y = x.to(device, non_blocking=True), t.to(device, non_blocking=True), y.to(device)
            loss = F.cross_entropy(model(city, x, t), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)
        if rank == 0:
            print(f"epoch {epoch} loss {(run[0] / run[1]).item():.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "cities": args.cities},
                       os.path.join(args.out, "last.pt"))
        dist.barrier()

    stats = evaluate(net, tests, rank, world, device, args.seq_len)
    if rank == 0:
        for c, city in enumerate(args.cities):
            s = stats[c]
            print(f"{city:>14s}: acc@1 {(s[0] / s[2]).item():.4f} acc@10 {(s[1] / s[2]).item():.4f} n={int(s[2])}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
