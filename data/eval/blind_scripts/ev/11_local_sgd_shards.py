"""Local SGD with periodic parameter averaging on the keyword-spotting features.

Each worker streams its own set of feature shards (features_XXXX.npz, written by
prep/extract_logmel.py: x [N, 40, 101] float16 log-mel, y [N] int64), runs plain
momentum SGD locally and averages parameters with all_reduce every H steps.

    torchrun --nproc_per_node=8 local_sgd_shards.py --shards /data/kws/train --val /data/kws/val.npz --H 8
"""
import argparse
import glob
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, Subset


class ShardStream(IterableDataset):
    def __init__(self, files, seed, shuffle_buffer=4096):
        self.files = list(files)
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rng = random.Random(self.seed + self.epoch)
        files = self.files[:]
        rng.shuffle(files)
        info = torch.utils.data.get_worker_info()
        if info is not None:
            files = files[info.id::info.num_workers]
        buf = []
        for f in files:
            with np.load(f) as d:
                xs, ys = d["x"], d["y"]
            for i in range(len(ys)):
                buf.append((torch.from_numpy(xs[i].astype(np.float32)), int(ys[i])))
                if len(buf) >= self.shuffle_buffer:
                    yield buf.pop(rng.randrange(len(buf)))
        rng.shuffle(buf)
        yield from buf


class KWSNet(nn.Module):
    def __init__(self, n_classes=35, width=64):
        super().__init__()
        def block(cin, cout, pool):
            layers = [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.ReLU(inplace=True)]
            if pool:
                layers.append(nn.MaxPool2d(2))
            return layers
        self.features = nn.Sequential(
            *block(1, width, True), *block(width, 2 * width, True),
            *block(2 * width, 4 * width, True), *block(4 * width, 4 * width, False),
        )
        self.classifier = nn.Linear(4 * width, n_classes)

    def forward(self, x):
        h = self.features(x.unsqueeze(1))
        return self.classifier(h.mean(dim=(2, 3)))


@torch.no_grad()
def average_parameters(model, world):
    flat = torch.cat([p.data.view(-1) for p in model.parameters()])
    dist.all_reduce(flat)
    flat.div_(world)
    off = 0
    for p in model.parameters():
        n = p.numel()
        p.data.copy_(flat[off:off + n].view_as(p))
        off += n


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    t = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device).float(), y.to(device)
        out = model(x)
        t[0] += F.cross_entropy(out, y, reduction="sum")
        t[1] += (out.argmax(1) == y).sum()
        t[2] += y.numel()
    dist.all_reduce(t)
    model.train()
    return (t[0] / t[2]).item(), (t[1] / t[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", default="results/kws_localsgd")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--wd", type=float, default=1e-4)
    ap.add_argument("--H", type=int, default=8, help="local steps between averaging")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    all_files = sorted(glob.glob(os.path.join(args.shards, "features_*.npz")))
    my_files = all_files[rank::world]
    train_ds = ShardStream(my_files, seed=args.seed + 1000 * rank)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, num_workers=4, pin_memory=True)

    with np.load(args.val) as d:
        val_ds = TensorDataset(torch.from_numpy(d["x"]), torch.from_numpy(d["y"]))
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=1024)

    model = KWSNet().to(device)
    average_parameters(model, world)  # start from the same point (mean of inits == identical for same seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.wd)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(all_files)} shards, {len(my_files)} on rank 0, H={args.H}, world={world}", flush=True)

    log = []
    step = 0
    for epoch in range(args.epochs):
        train_ds.set_epoch(epoch)
        lr = args.lr * 0.5 * (1 + np.cos(np.pi * epoch / args.epochs))
        for g in optimizer.param_groups:
            g["lr"] = lr
        t0 = time.time()
        loss_sum, n_batches = 0.0, 0
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            loss_sum += loss.item()
            n_batches += 1
            if step % args.H == 0:
                average_parameters(model, world)

        average_parameters(model, world)
        val_loss, val_acc = evaluate(model, val_loader, device)
        stats = torch.tensor([loss_sum, n_batches], device=device, dtype=torch.float64)
        dist.all_reduce(stats)
        rec = {"epoch": epoch, "lr": lr, "train_loss": (stats[0] / stats[1]).item(),
               "val_loss": val_loss, "val_acc": val_acc, "time": time.time() - t0}
        log.append(rec)
        if rank == 0:
            print(json.dumps(rec), flush=True)
            torch.save(model.state_dict(), os.path.join(args.out, f"kws_H{args.H}.pt"))
            with open(os.path.join(args.out, f"log_H{args.H}.json"), "w") as f:
                json.dump(log, f)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
