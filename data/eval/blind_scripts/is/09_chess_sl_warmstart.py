"""Supervised warm start for the chess self-play net.

Trains the policy/value net on positions from strong human games (Lichess
2200+ rated, preprocessed by tools/pgn_to_npy.py into memory-mapped arrays)
before self-play takes over.  The resulting checkpoint is generation 0 of the
self-play run.

Example:
    torchrun --nproc_per_node=8 chess_sl_warmstart.py \
        --data /datasets/lichess_2200 --epochs 6 --out runs/sl_gen0
"""
import argparse
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

N_PLANES = 19
N_MOVES = 4672  # 8x8x73 AlphaZero move encoding

logger = logging.getLogger(__name__)


class PositionArrays(Dataset):
    def __init__(self, root, lo, hi):
        self.planes = np.load(os.path.join(root, "planes.npy"), mmap_mode="r")
        self.moves = np.load(os.path.join(root, "moves.npy"), mmap_mode="r")
        self.results = np.load(os.path.join(root, "results.npy"), mmap_mode="r")
        self.lo, self.hi = lo, hi

    def __len__(self):
        return self.hi - self.lo

    def __getitem__(self, i):
        j = self.lo + i
        x = torch.from_numpy(np.unpackbits(self.planes[j]).reshape(N_PLANES, 8, 8).astype(np.float32))
        return x, int(self.moves[j]), float(self.results[j])


class SE(nn.Module):
    def __init__(self, ch, r=4):
        super().__init__()
        self.fc1 = nn.Linear(ch, ch // r)
        self.fc2 = nn.Linear(ch // r, 2 * ch)

    def forward(self, x):
        s = F.relu(self.fc1(x.mean((2, 3))))
        w, b = self.fc2(s).chunk(2, dim=1)
        return x * torch.sigmoid(w)[..., None, None] + b[..., None, None]


class ResSE(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(ch)
        self.se = SE(ch)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.se(self.bn2(self.conv2(y)))
        return F.relu(x + y)


class ChessNet(nn.Module):
    def __init__(self, blocks=10, ch=128):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(N_PLANES, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch), nn.ReLU())
        self.tower = nn.Sequential(*[ResSE(ch) for _ in range(blocks)])
        self.policy = nn.Sequential(nn.Conv2d(ch, ch, 3, padding=1), nn.ReLU(), nn.Conv2d(ch, 73, 1))
        self.value = nn.Sequential(nn.Conv2d(ch, 32, 1), nn.ReLU(), nn.Flatten(),
                                   nn.Linear(32 * 64, 128), nn.ReLU(), nn.Linear(128, 3))  # W/D/L

    def forward(self, x):
        h = self.tower(self.stem(x))
        return self.policy(h).flatten(1), self.value(h)


def wdl_target(result):
    # result in {-1, 0, 1} from side to move -> class index (loss, draw, win)
    return (result + 1).long()


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/sl_gen0")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--val-frac", type=float, default=0.01)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--value-weight", type=float, default=0.5)
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s",
                        level=logging.INFO if rank == 0 else logging.ERROR)

    total = len(np.load(os.path.join(args.data, "results.npy"), mmap_mode="r"))
    n_val = int(total * args.val_frac)
    # games were shuffled at preprocessing time, the tail is a held-out set of whole games
    train_ds = PositionArrays(args.data, 0, total - n_val)
    val_ds = PositionArrays(args.data, total - n_val, total)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler,
                        num_workers=args.workers, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(ChessNet()).to(device)
    model = DDP(model, device_ids=[args.local_rank])
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": args.wd},
                           {"params": no_decay, "weight_decay": 0.0}],
                          lr=args.lr, momentum=0.9, nesterov=True)
    steps_total = args.epochs * len(train_dl)
    warmup = 1000
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps_total) / steps_total)))
    scaler = torch.cuda.amp.GradScaler()
    os.makedirs(args.out, exist_ok=True)

    logger.info("train %d val %d positions, %d steps/epoch on %d GPUs", len(train_ds), len(val_ds),
                len(train_dl), world)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, mv, res) in enumerate(train_dl):
            x = x.to(device, non_blocking=True)
            mv = mv.to(device, non_blocking=True)
            res = res.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                p_logits, v_logits = model(x)
                loss_p = F.cross_entropy(p_logits, mv)
                loss_v = F.cross_entropy(v_logits, wdl_target(res))
                loss = loss_p + args.value_weight * loss_v
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if i % 200 == 0:
                logger.info("ep %d it %d/%d loss_p %.3f loss_v %.3f lr %.4f %.0f pos/s", epoch, i, len(train_dl),
                            loss_p.item(), loss_v.item(), sched.get_last_lr()[0],
                            (i + 1) * args.batch_size * world / (time.time() - t0))

        model.eval()
        agg = torch.zeros(4, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, mv, res in val_dl:
                x, mv, res = x.to(device), mv.to(device), res.to(device)
                p_logits, v_logits = model(x)
                agg[0] += F.cross_entropy(p_logits.float(), mv, reduction="sum")
                agg[1] += (p_logits.argmax(1) == mv).sum()
                agg[2] += F.cross_entropy(v_logits.float(), wdl_target(res), reduction="sum")
                agg[3] += x.shape[0]
        dist.all_reduce(agg)
        logger.info("epoch %d val: policy CE %.4f top1 %.4f value CE %.4f", epoch,
                    agg[0] / agg[3], agg[1] / agg[3], agg[2] / agg[3])

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "args": vars(args)},
                       os.path.join(args.out, f"sl_epoch{epoch}.pt"))
        dist.barrier()

    if rank == 0:
        torch.save({"model": model.module.state_dict(), "generation": 0},
                   os.path.join(args.out, "gen_0000.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
