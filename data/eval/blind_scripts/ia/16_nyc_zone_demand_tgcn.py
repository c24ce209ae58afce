"""Zone-level taxi demand forecasting for NYC (TLC trip records, 263 taxi zones).

Hourly pickup counts per zone (built from the yellow/green trip parquet files
by the preprocessing notebook) are forecast one hour ahead from the last 12 hours
with a T-GCN: a GCN over the zone adjacency graph (shared borders in the
taxi_zones shapefile) inside a GRU cell.

    torchrun --nproc_per_node=4 16_nyc_zone_demand_tgcn.py --counts data/nyc/zone_hourly_2019_2023.npy
"""
import argparse
import os
import time

import geopandas as gpd
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", default="data/nyc/zone_hourly_2019_2023.npy")  # (T, 263)
    ap.add_argument("--zones", default="data/nyc/taxi_zones/taxi_zones.shp")
    ap.add_argument("--out", default="ckpt/nyc_tgcn")
    ap.add_argument("--history", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--val_hours", type=int, default=24 * 60)
    ap.add_argument("--test_hours", type=int, default=24 * 60)
    return ap.parse_args()


def zone_adjacency(shp_path):
    gdf = gpd.read_file(shp_path).sort_values("LocationID").reset_index(drop=True)
    n = len(gdf)
    adj = np.eye(n, dtype=np.float32)
    sindex = gdf.sindex
    for i, geom in enumerate(gdf.geometry):
        for j in sindex.query(geom, predicate="touches"):
            adj[i, j] = 1.0
    deg = adj.sum(1)
    d = np.diag(1.0 / np.sqrt(deg))
    return torch.from_numpy(d @ adj @ d)


class WindowDataset(Dataset):
    def __init__(self, series, history, start, end):
        self.s, self.h = series, history
        self.idx = list(range(max(start, history), end))

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        t = self.idx[i]
        return self.s[t - self.h: t], self.s[t]


class TGCNCell(nn.Module):
    def __init__(self, adj, hidden):
        super().__init__()
        self.register_buffer("adj", adj)
        self.gates = nn.Linear(hidden + 1, 2 * hidden)
        self.cand = nn.Linear(hidden + 1, hidden)
        self.hidden = hidden

    def gconv(self, x, h, lin):
        z = torch.cat([x.unsqueeze(-1), h], -1)  # (B, N, 1 + H)
        return lin(torch.einsum("nm,bmf->bnf", self.adj, z))

    def forward(self, x, h):
        r, u = torch.sigmoid(self.gconv(x, h, self.gates)).chunk(2, -1)
        c = torch.tanh(self.gconv(x, r * h, self.cand))
        return u * h + (1 - u) * c


class TGCN(nn.Module):
    def __init__(self, adj, hidden):
        super().__init__()
        self.cell = TGCNCell(adj, hidden)
        self.head = nn.Linear(hidden, 1)

    def forward(self, seq):  # (B, T, N)
        B, T, N = seq.shape
        h = seq.new_zeros(B, N, self.cell.hidden)
        for t in range(T):
            h = self.cell(seq[:, t], h)
        return self.head(h).squeeze(-1)


@torch.no_grad()
def evaluate(net, loader, device, mu, sigma):
    net.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        pred = net(x) * sigma + mu
        true = y * sigma + mu
        err = (pred - true).double()
        s += torch.stack([err.abs().sum(), (err ** 2).sum(), torch.tensor(float(err.numel()), device=device,
                                                                           dtype=torch.float64)])
    dist.all_reduce(s)
    net.train()
    return (s[0] / s[2]).item(), (s[1] / s[2]).sqrt().item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    counts = np.load(args.counts).astype(np.float32)
    T = len(counts)
    t_val, t_test = T - args.val_hours - args.test_hours, T - args.test_hours
    mu, sigma = float(counts[:t_val].mean()), float(counts[:t_val].std())
    series = torch.from_numpy((counts - mu) / sigma)
    adj = zone_adjacency(args.zones)

    train_ds = WindowDataset(series, args.history, 0, t_val)
    val_ds = WindowDataset(series, args.history, t_val, t_test)
    test_ds = WindowDataset(series, args.history, t_test, T)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=2, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=128)

    model = DDP(TGCN(adj, args.hidden).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1.5e-4)
    best_path = os.path.join(args.out, "best.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"hours={T} zones={counts.shape[1]} train={len(train_ds)} val={len(val_ds)} test={len(test_ds)}")

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tl = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tl += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tl)
        mae, rmse = evaluate(model.module, val_dl, device, mu, sigma)
        if rank == 0:
            print(f"epoch {epoch:03d} train_mse {(tl[0] / tl[1]).item():.4f} val MAE {mae:.2f} RMSE {rmse:.2f} "
                  f"({time.time() - t0:.1f}s)", flush=True)
            if rmse < best:
                best = rmse
                torch.save({"model": model.state_dict(), "epoch": epoch, "mu": mu, "sigma": sigma}, best_path)
        dist.barrier()

    if rank == 0:
        ck = torch.load(best_path, map_location=device)
        final = TGCN(adj, args.hidden).to(device)
        final.load_state_dict(ck["model"])
        final.eval()
        errs = []
        with torch.no_grad():
            for x, y in DataLoader(test_ds, batch_size=256):
                pred = final(x.to(device)) * sigma + mu
                errs.append((pred - (y.to(device) * sigma + mu)).cpu())
        e = torch.cat(errs)
        print(f"test (best epoch {ck['epoch']}): MAE {e.abs().mean():.2f} RMSE {e.pow(2).mean().sqrt():.2f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
