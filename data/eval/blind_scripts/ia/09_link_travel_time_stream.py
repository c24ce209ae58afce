"""Link-level travel time estimation from map-matched DiDi trips (streaming).

Input shards are parquet files written by the map-matching Spark job: one row
per trip, with the matched link sequence, per-link lengths and the observed
per-link traversal times. There are too many trips to index, so each rank
streams its own subset of shard files and an epoch is a fixed number of steps.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        09_link_travel_time_stream.py --shards '/shared/didi_mm/2018-*/part-*.parquet'
"""
import argparse
import glob
import math
import os
import random
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", required=True)
    ap.add_argument("--val_file", default="/shared/didi_mm/val/val.parquet")
    ap.add_argument("--out", default="/shared/exp/link_tte")
    ap.add_argument("--max_links", type=int, default=128)
    ap.add_argument("--emb", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--steps_per_epoch", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=11)
    return ap.parse_args()


def row_to_example(links, lens, times, depart, max_links):
    links = np.asarray(links[:max_links], np.int64)
    lens = np.asarray(lens[:max_links], np.float32)
    times = np.asarray(times[:max_links], np.float32)
    slot = (int(depart) // 300) % 288
    return links, lens, times, slot


class ShardStream(IterableDataset):
    def __init__(self, files, max_links, seed):
        self.files, self.max_links, self.seed = files, max_links, seed

    def __iter__(self):
        wi = get_worker_info()
        wid, nw = (wi.id, wi.num_workers) if wi else (0, 1)
        files = self.files[wid::nw]
        if not files:
            return
        rng = random.Random(self.seed + wid)
        while True:
            rng.shuffle(files)
            for f in files:
                t = pq.read_table(f, columns=["links", "link_len", "link_time", "depart_ts"]).to_pydict()
                order = list(range(len(t["links"])))
                rng.shuffle(order)
                for i in order:
                    yield row_to_example(t["links"][i], t["link_len"][i], t["link_time"][i],
                                         t["depart_ts"][i], self.max_links)


def collate(batch):
    n = max(len(b[0]) for b in batch)
    B = len(batch)
    links = torch.zeros(B, n, dtype=torch.long)
    lens = torch.zeros(B, n)
    times = torch.zeros(B, n)
    mask = torch.zeros(B, n, dtype=torch.bool)
    for i, (l, ln, tm, _) in enumerate(batch):
        k = len(l)
        links[i, :k] = torch.from_numpy(l) + 1  # 0 = padding
        lens[i, :k] = torch.from_numpy(ln)
        times[i, :k] = torch.from_numpy(tm)
        mask[i, :k] = True
    slots = torch.tensor([b[3] for b in batch])
    return links, lens, times, mask, slots


class LinkTTE(nn.Module):
    def __init__(self, num_links, emb, hidden):
        super().__init__()
        self.link = nn.Embedding(num_links + 1, emb, padding_idx=0)
        self.slot = nn.Embedding(288, 16)
        self.lstm = nn.LSTM(emb + 16 + 1, hidden, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, links, lens, slots):
        T = links.size(1)
        s = self.slot(slots)[:, None].expand(-1, T, -1)
        x = torch.cat([self.link(links), s, torch.log1p(lens)[..., None]], -1)
        h, _ = self.lstm(x)
        return self.head(h).squeeze(-1)  # log seconds per link


def masked_loss(pred_log, times, mask):
    return ((pred_log - torch.log1p(times)).abs() * mask).sum() / mask.sum()


@torch.no_grad()
def evaluate(net, val_rows, device, rank, world, bs=512):
    net.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)  # abs err trip, ape trip, n trips
    mine = val_rows[rank::world]
    for i in range(0, len(mine), bs):
        links, lens, times, mask, slots = (t.to(device) for t in collate(mine[i:i + bs]))
        pred = torch.expm1(net(links, lens, slots)).clamp(min=0) * mask
        trip_pred, trip_true = pred.sum(1), (times * mask).sum(1)
        acc[0] += (trip_pred - trip_true).abs().sum()
        acc[1] += ((trip_pred - trip_true).abs() / trip_true.clamp(min=1)).sum()
        acc[2] += len(trip_true)
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    files = sorted(glob.glob(args.shards))
    my_files = files[rank::world]
    num_links = 0
    for f in my_files:
        col = pq.read_table(f, columns=["links"]).column("links").combine_chunks().flatten()
        num_links = max(num_links, int(np.max(col.to_numpy())) + 1)

    vt = pq.read_table(args.val_file, columns=["links", "link_len", "link_time", "depart_ts"]).to_pydict()
    val_rows = [row_to_example(l, ln, tm, d, args.max_links)
                for l, ln, tm, d in zip(vt["links"], vt["link_len"], vt["link_time"], vt["depart_ts"])]
    val_rows = [r for r in val_rows if r[0].max() < num_links]

    stream = ShardStream(my_files, args.max_links, args.seed + 7919 * rank)
    loader = DataLoader(stream, batch_size=args.batch_size, collate_fn=collate, num_workers=4,
                        pin_memory=True, prefetch_factor=4)
    it = iter(loader)

    net = LinkTTE(num_links, args.emb, args.hidden).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    total = args.epochs * args.steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(files)} shards, world={world}, links={num_links}, val trips={len(val_rows)}")

    best_mape = float("inf")
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for step in range(args.steps_per_epoch):
            links, lens, times, mask, slots = (t.to(device, non_blocking=True) for t in next(it))
            loss = masked_loss(model(links, lens, slots), times, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)
        mae, mape = evaluate(net, val_rows, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} train_l1(log) {(run[0] / run[1]).item():.4f} trip MAE {mae:.1f}s "
                  f"MAPE {mape:.4f} ({time.time() - t0:.0f}s)", flush=True)
            ck = {"model": net.state_dict(), "num_links": num_links, "epoch": epoch, "mape": mape}
            torch.save(ck, os.path.join(args.out, "last.pt"))
            if mape < best_mape:
                best_mape = mape
                torch.save(ck, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
