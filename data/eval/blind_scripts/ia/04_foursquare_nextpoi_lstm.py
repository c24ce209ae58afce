"""Next-POI recommendation on Foursquare check-ins (NYC / TKY).

Per user, check-ins are cut into trajectories by a 24h gap; the first 80% of
each user's trajectories go to training and the rest to test (standard protocol
from the GETNext / STAN line of work). Reports Acc@{1,5,10} and MRR.

    torchrun --standalone --nproc_per_node=4 04_foursquare_nextpoi_lstm.py --dataset nyc
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence, pad_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

FILES = {"nyc": "dataset_TSMC2014_NYC.csv", "tky": "dataset_TSMC2014_TKY.csv"}


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", choices=list(FILES), default="nyc")
    p.add_argument("--root", default="data/foursquare")
    p.add_argument("--logdir", default="runs/nextpoi")
    p.add_argument("--gap_hours", type=float, default=24.0)
    p.add_argument("--min_poi_visits", type=int, default=10)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--dist_buckets", type=int, default=32)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def haversine_km(lat1, lon1, lat2, lon2):
    lat1, lon1, lat2, lon2 = map(np.radians, (lat1, lon1, lat2, lon2))
    a = np.sin((lat2 - lat1) / 2) ** 2 + np.cos(lat1) * np.cos(lat2) * np.sin((lon2 - lon1) / 2) ** 2
    return 2 * 6371.0 * np.arcsin(np.sqrt(a))


def load_checkins(args):
    df = pd.read_csv(os.path.join(args.root, FILES[args.dataset]), encoding="latin-1")
    df["ts"] = pd.to_datetime(df.utcTimestamp, format="%a %b %d %H:%M:%S +0000 %Y")
    df["ts"] = df.ts + pd.to_timedelta(df.timezoneOffset, unit="m")
    vc = df.venueId.value_counts()
    df = df[df.venueId.isin(vc[vc >= args.min_poi_visits].index)]
    poi_ids = {v: i + 1 for i, v in enumerate(sorted(df.venueId.unique()))}
    cat_ids = {c: i + 1 for i, c in enumerate(sorted(df.venueCategoryId.unique()))}
    df["poi"] = df.venueId.map(poi_ids)
    df["cat"] = df.venueCategoryId.map(cat_ids)
    df = df.sort_values(["userId", "ts"])
    return df, len(poi_ids) + 1, len(cat_ids) + 1


def build_trajectories(df, gap_hours, dist_buckets):
    edges = np.logspace(-2, 2, dist_buckets - 1)
    train, test = [], []
    for _, g in df.groupby("userId", sort=True):
        ts = g.ts.values
        new = np.concatenate([[True], np.diff(ts) > np.timedelta64(int(gap_hours * 3600), "s")])
        tid = np.cumsum(new)
        d = haversine_km(g.latitude.values[:-1], g.longitude.values[:-1],
                         g.latitude.values[1:], g.longitude.values[1:])
        dbin = np.concatenate([[0], np.digitize(d, edges) + 1])
        hour = g.ts.dt.hour.values + 24 * (g.ts.dt.dayofweek.values >= 5)
        trajs = []
        for t in np.unique(tid):
            m = tid == t
            if m.sum() < 3:
                continue
            trajs.append((g.poi.values[m], g.cat.values[m], hour[m], dbin[m]))
        if len(trajs) < 3:
            continue
        cut = int(0.8 * len(trajs))
        train += trajs[:cut]
        test += trajs[cut:]
    return train, test


class TrajDataset(Dataset):
    def __init__(self, trajs):
        self.trajs = trajs

    def __len__(self):
        return len(self.trajs)

    def __getitem__(self, i):
        poi, cat, hour, dbin = (torch.as_tensor(a, dtype=torch.long) for a in self.trajs[i])
        return poi[:-1], cat[:-1], hour[:-1], dbin[:-1], poi[1:]


def collate(batch):
    cols = list(zip(*batch))
    lengths = torch.tensor([len(x) for x in cols[0]])
    padded = [pad_sequence(c, batch_first=True) for c in cols]
    return (*padded, lengths)


class NextPOI(nn.Module):
    def __init__(self, n_poi, n_cat, dim, hidden, dist_buckets):
        super().__init__()
        self.poi = nn.Embedding(n_poi, dim, padding_idx=0)
        self.cat = nn.Embedding(n_cat, dim // 2, padding_idx=0)
        self.hour = nn.Embedding(48, dim // 4)
        self.dist = nn.Embedding(dist_buckets + 1, dim // 4)
        self.rnn = nn.LSTM(dim + dim // 2 + dim // 2, hidden, batch_first=True)
        self.out = nn.Linear(hidden, n_poi)

    def forward(self, poi, cat, hour, dbin, lengths):
        x = torch.cat([self.poi(poi), self.cat(cat), self.hour(hour), self.dist(dbin)], -1)
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        h, _ = self.rnn(packed)
        h, _ = pad_packed_sequence(h, batch_first=True, total_length=poi.size(1))
        return self.out(h)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    hits = {1: 0, 5: 0, 10: 0}
    rr, n = 0.0, 0
    for poi, cat, hour, dbin, tgt, lengths in loader:
        poi, cat, hour, dbin, tgt = (t.to(device) for t in (poi, cat, hour, dbin, tgt))
        logits = net(poi, cat, hour, dbin, lengths)
        # score only the last step of each trajectory
        idx = (lengths - 1).to(device)
        last = logits[torch.arange(len(idx), device=device), idx]
        y = tgt[torch.arange(len(idx), device=device), idx]
        rank = (last > last.gather(1, y[:, None])).sum(1) + 1
        for k in hits:
            hits[k] += (rank <= k).sum().item()
        rr += (1.0 / rank.float()).sum().item()
        n += len(y)
    net.train()
    out = {f"acc@{k}": v / n for k, v in hits.items()}
    out["mrr"] = rr / n
    return out


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    df, n_poi, n_cat = load_checkins(args)
    train_trajs, test_trajs = build_trajectories(df, args.gap_hours, args.dist_buckets)
    train_ds, test_ds = TrajDataset(train_trajs), TrajDataset(test_trajs)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    train_dl = DataLoader(train_ds, args.bs, sampler=train_sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True, drop_last=True)
    test_dl = DataLoader(test_ds, 256, sampler=test_sampler, collate_fn=collate, num_workers=2)

    net = NextPOI(n_poi, n_cat, args.dim, args.hidden, args.dist_buckets).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.wd)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=3)

    writer = None
    if rank == 0:
        run_dir = os.path.join(args.logdir, f"{args.dataset}_{time.strftime('%m%d_%H%M')}")
        writer = SummaryWriter(run_dir)
        print(f"POIs={n_poi - 1} cats={n_cat - 1} train={len(train_ds)} test={len(test_ds)}")

    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for poi, cat, hour, dbin, tgt, lengths in train_dl:
            poi, cat, hour, dbin, tgt = (t.to(device, non_blocking=True) for t in (poi, cat, hour, dbin, tgt))
            logits = model(poi, cat, hour, dbin, lengths)
            loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        metrics = evaluate(net, test_dl, device)
        sched.step(metrics["acc@1"])
        if rank == 0:
            writer.add_scalar("train/loss", (tot[0] / tot[1]).item(), epoch)
            for k, v in metrics.items():
                writer.add_scalar(f"test/{k}", v, epoch)
            print(f"epoch {epoch:02d} loss {(tot[0] / tot[1]).item():.4f} " +
                  " ".join(f"{k} {v:.4f}" for k, v in metrics.items()), flush=True)
            if metrics["acc@1"] > best:
                best = metrics["acc@1"]
                torch.save({"model": net.state_dict(), "epoch": epoch, "metrics": metrics,
                            "n_poi": n_poi, "n_cat": n_cat}, os.path.join(writer.log_dir, "best.pt"))
        dist.barrier()

    if rank == 0:
        writer.close()
        print(f"best acc@1 {best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
