#!/usr/bin/env python3
"""DeepLOB-style CNN + LSTM on limit order book snapshots (FI-2010 layout).

Predicts the mid-price direction (down / stationary / up) at horizon k from the
last T snapshots of 10 price levels (ask/bid price + volume = 40 features).

    torchrun --nproc_per_node=4 01_deeplob_fi2010.py --train-files ... --test-files ...
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("deeplob")

# row offset of the label for each horizon inside the last 5 rows of an FI-2010 file
HORIZONS = {1: 0, 2: 1, 3: 2, 5: 3, 10: 4}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-files", nargs="+", required=True)
    p.add_argument("--test-files", nargs="+", required=True)
    p.add_argument("--horizon", type=int, default=10, choices=sorted(HORIZONS))
    p.add_argument("--window", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--out", default="runs/deeplob")
    p.add_argument("--resume", default="")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class LOBWindows(Dataset):
    """FI-2010 text files are (149, N): rows 0..39 are LOB levels, last 5 rows labels."""

    def __init__(self, files, window, horizon):
        data = np.concatenate([np.loadtxt(f) for f in files], axis=1)
        self.x = torch.from_numpy(data[:40, :].T.astype(np.float32))
        self.y = torch.from_numpy(data[-5 + HORIZONS[horizon], :].astype(np.int64) - 1)
        self.window = window

    def __len__(self):
        return self.x.shape[0] - self.window + 1

    def __getitem__(self, i):
        x = self.x[i : i + self.window].unsqueeze(0)  # (1, T, 40)
        y = self.y[i + self.window - 1]
        return x, y


def conv_block(cin, cout, kernel, stride=1):
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel_size=kernel, stride=stride),
        nn.LeakyReLU(0.01),
        nn.BatchNorm2d(cout),
    )


class DeepLOB(nn.Module):
    def __init__(self, n_classes=3, hidden=64):
        super().__init__()
        self.conv1 = nn.Sequential(
            conv_block(1, 32, (1, 2), (1, 2)),
            nn.ZeroPad2d((0, 0, 3, 0)), conv_block(32, 32, (4, 1)),
            nn.ZeroPad2d((0, 0, 3, 0)), conv_block(32, 32, (4, 1)),
        )
        self.conv2 = nn.Sequential(
            conv_block(32, 32, (1, 2), (1, 2)),
            nn.ZeroPad2d((0, 0, 3, 0)), conv_block(32, 32, (4, 1)),
            nn.ZeroPad2d((0, 0, 3, 0)), conv_block(32, 32, (4, 1)),
        )
        self.conv3 = nn.Sequential(
            conv_block(32, 32, (1, 10)),
            nn.ZeroPad2d((0, 0, 3, 0)), conv_block(32, 32, (4, 1)),
            nn.ZeroPad2d((0, 0, 3, 0)), conv_block(32, 32, (4, 1)),
        )
        self.inp1 = nn.Sequential(conv_block(32, 64, (1, 1)), nn.ZeroPad2d((0, 0, 1, 1)), conv_block(64, 64, (3, 1)))
        self.inp2 = nn.Sequential(conv_block(32, 64, (1, 1)), nn.ZeroPad2d((0, 0, 2, 2)), conv_block(64, 64, (5, 1)))
        self.inp3 = nn.Sequential(nn.MaxPool2d((3, 1), stride=(1, 1), padding=(1, 0)), conv_block(32, 64, (1, 1)))
        self.lstm = nn.LSTM(input_size=192, hidden_size=hidden, batch_first=True)
        self.fc = nn.Linear(hidden, n_classes)

    def forward(self, x):
        x = self.conv3(self.conv2(self.conv1(x)))
        x = torch.cat([self.inp1(x), self.inp2(x), self.inp3(x)], dim=1)  # (B, 192, T, 1)
        x = x.squeeze(-1).permute(0, 2, 1)
        out, _ = self.lstm(x)
        return self.fc(out[:, -1])


@torch.no_grad()
def evaluate(net, dataset, device, rank, world_size, batch_size):
    """Each rank scores a disjoint stride of the test set; confusion matrices are summed."""
    net.eval()
    shard = Subset(dataset, range(rank, len(dataset), world_size))
    loader = DataLoader(shard, batch_size=batch_size * 4, shuffle=False, num_workers=2)
    conf = torch.zeros(3, 3, dtype=torch.long, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        pred = net(x).argmax(-1)
        conf += torch.bincount(y * 3 + pred, minlength=9).view(3, 3)
    dist.all_reduce(conf)
    conf = conf.double()
    acc = (conf.diag().sum() / conf.sum()).item()
    precision = conf.diag() / conf.sum(0).clamp(min=1)
    recall = conf.diag() / conf.sum(1).clamp(min=1)
    f1 = (2 * precision * recall / (precision + recall).clamp(min=1e-12)).mean().item()
    return acc, f1


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    train_set = LOBWindows(args.train_files, args.window, args.horizon)
    test_set = LOBWindows(args.test_files, args.window, args.horizon)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=args.workers > 0)

    model = DeepLOB().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1)

    start_epoch, best_f1 = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best_f1 = ckpt["epoch"] + 1, ckpt["best_f1"]

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        logger.info("train windows=%d test windows=%d world=%d", len(train_set), len(test_set), world_size)

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        stats = torch.zeros(3, device=device)  # loss sum, correct, count
        for x, y in train_loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            stats[0] += loss.detach() * y.numel()
            stats[1] += (logits.argmax(-1) == y).sum()
            stats[2] += y.numel()
        dist.all_reduce(stats)
        train_loss = (stats[0] / stats[2]).item()
        train_acc = (stats[1] / stats[2]).item()

        acc, f1 = evaluate(model.module, test_set, device, rank, world_size, args.batch_size)
        if rank == 0:
            logger.info("epoch %d loss %.4f train_acc %.4f test_acc %.4f macro_f1 %.4f (%.0fs)",
                        epoch, train_loss, train_acc, acc, f1, time.time() - t0)
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": epoch, "best_f1": max(best_f1, f1), "args": vars(args)}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if f1 > best_f1:
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
                with open(os.path.join(args.out, "best.json"), "w") as fh:
                    json.dump({"epoch": epoch, "acc": acc, "f1": f1}, fh)
        best_f1 = max(best_f1, f1)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
