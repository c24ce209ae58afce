"""Travel-time estimation (ETA) on map-matched Chengdu ride-hailing trips.

Each trip is a path of road segments from the map-matching step plus its
departure time. A GraphSAGE encoder over the road network produces segment
embeddings; a small transformer pools them along the path and regresses the
log travel time.

Run on one node with N GPUs:
    python 03_chengdu_eta_graphsage.py --gpus 4 --trips data/chengdu/trips_mm.pkl \
        --graph data/chengdu/road_graph.pt
"""
import argparse
import math
import os
import pickle
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.nn import SAGEConv


def get_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trips", default="data/chengdu/trips_mm.pkl")
    ap.add_argument("--graph", default="data/chengdu/road_graph.pt")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--port", default="29533")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--gnn_layers", type=int, default=2)
    ap.add_argument("--path_layers", type=int, default=2)
    ap.add_argument("--max_path", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--seed", type=int, default=2024)
    ap.add_argument("--save_dir", default="ckpt/chengdu_eta")
    return ap.parse_args()


class TripDataset(Dataset):
    def __init__(self, trips, max_path):
        self.trips = trips
        self.max_path = max_path

    def __len__(self):
        return len(self.trips)

    def __getitem__(self, i):
        segs, depart_ts, duration = self.trips[i]
        segs = torch.as_tensor(segs[: self.max_path], dtype=torch.long)
        lt = time.gmtime(depart_ts + 8 * 3600)  # Asia/Shanghai
        slot = lt.tm_wday * 48 + lt.tm_hour * 2 + lt.tm_min // 30
        return segs, slot, math.log1p(duration)


def collate(batch):
    segs, slots, ys = zip(*batch)
    lengths = torch.tensor([len(s) for s in segs])
    padded = pad_sequence(segs, batch_first=True, padding_value=0)
    mask = torch.arange(padded.size(1))[None, :] >= lengths[:, None]
    return padded, mask, torch.tensor(slots), torch.tensor(ys, dtype=torch.float32)


class RoadETA(nn.Module):
    def __init__(self, in_dim, hidden, gnn_layers, path_layers, max_path):
        super().__init__()
        self.inp = nn.Linear(in_dim, hidden)
        self.convs = nn.ModuleList([SAGEConv(hidden, hidden) for _ in range(gnn_layers)])
        self.slot = nn.Embedding(7 * 48, hidden)
        self.pos = nn.Embedding(max_path, hidden)
        layer = nn.TransformerEncoderLayer(hidden, 4, 4 * hidden, 0.1, batch_first=True)
        self.path_enc = nn.TransformerEncoder(layer, path_layers)
        self.reg = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def encode_roads(self, x, edge_index):
        h = torch.relu(self.inp(x))
        for conv in self.convs:
            h = h + torch.relu(conv(h, edge_index))
        return h

    def forward(self, x, edge_index, segs, mask, slot):
        road = self.encode_roads(x, edge_index)
        T = segs.size(1)
        h = road[segs] + self.pos(torch.arange(T, device=segs.device))[None]
        h = self.path_enc(h, src_key_padding_mask=mask)
        h = h.masked_fill(mask[..., None], 0.0)
        pooled = h.sum(1) / (~mask).sum(1, keepdim=True).clamp(min=1)
        return self.reg(torch.cat([pooled, self.slot(slot)], -1)).squeeze(-1)


def split_trips(trips, seed):
    idx = list(range(len(trips)))
    random.Random(seed).shuffle(idx)
    n = len(idx)
    tr, va = idx[: int(0.8 * n)], idx[int(0.8 * n): int(0.9 * n)]
    return [trips[i] for i in tr], [trips[i] for i in va]


@torch.no_grad()
def validate(net, graph, loader, device):
    net.eval()
    s = torch.zeros(4, device=device, dtype=torch.float64)  # |err| s, ape, sq err, n
    for segs, mask, slot, y in loader:
        segs, mask, slot, y = segs.to(device), mask.to(device), slot.to(device), y.to(device)
        pred = torch.expm1(net(graph.x, graph.edge_index, segs, mask, slot))
        true = torch.expm1(y)
        err = (pred - true).double()
        s[0] += err.abs().sum()
        s[1] += (err.abs() / true.double().clamp(min=1.0)).sum()
        s[2] += (err ** 2).sum()
        s[3] += y.numel()
    dist.all_reduce(s)
    net.train()
    return {"MAE": (s[0] / s[3]).item(), "MAPE": (s[1] / s[3]).item(),
            "RMSE": math.sqrt((s[2] / s[3]).item())}


def worker(rank, cfg):
    world_size = cfg.gpus
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)

    with open(cfg.trips, "rb") as f:
        trips = pickle.load(f)
    graph = torch.load(cfg.graph, map_location="cpu", weights_only=False).to(device)
    train_trips, val_trips = split_trips(trips, cfg.seed)
    train_ds = TripDataset(train_trips, cfg.max_path)
    val_ds = Subset(TripDataset(val_trips, cfg.max_path), range(rank, len(val_trips), world_size))

    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=256, shuffle=False, collate_fn=collate, num_workers=2)

    net = RoadETA(graph.x.size(1), cfg.hidden, cfg.gnn_layers, cfg.path_layers, cfg.max_path).to(device)
    model = DDP(net, device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs)
    loss_fn = nn.SmoothL1Loss(beta=0.1)

    if rank == 0:
        os.makedirs(cfg.save_dir, exist_ok=True)
        print(f"segments={graph.num_nodes} train={len(train_ds)} val={len(val_trips)} gpus={world_size}")
    best = float("inf")
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        run = torch.zeros(2, device=device)
        for segs, mask, slot, y in train_loader:
            segs, mask = segs.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            slot, y = slot.to(device, non_blocking=True), y.to(device, non_blocking=True)
            pred = model(graph.x, graph.edge_index, segs, mask, slot)
            loss = loss_fn(pred, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            run[0] += loss.detach()
            run[1] += 1
        sched.step()
        dist.all_reduce(run)

        metrics = validate(net, graph, val_loader, device)
        if rank == 0:
            print(f"[{epoch:03d}] loss={(run[0] / run[1]).item():.4f} MAE={metrics['MAE']:.1f}s "
                  f"MAPE={metrics['MAPE']:.3f} RMSE={metrics['RMSE']:.1f}s ({time.time() - tic:.0f}s)")
            ckpt = {"model": net.state_dict(), "epoch": epoch, "metrics": metrics, "cfg": vars(cfg)}
            torch.save(ckpt, os.path.join(cfg.save_dir, "last.pt"))
            if metrics["MAPE"] < best:
                best = metrics["MAPE"]
                torch.save(ckpt, os.path.join(cfg.save_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    cfg = get_config()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", cfg.port)
    mp.spawn(worker, args=(cfg), nprocs=cfg.gpus, join=True)


if __name__ == "__main__":
    main()
