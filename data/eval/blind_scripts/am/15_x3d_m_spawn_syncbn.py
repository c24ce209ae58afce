"""X3D-M on Kinetics-400, launched with torch.multiprocessing.spawn (one process per GPU).

Single node:   python 15_x3d_m_spawn_syncbn.py --data /data/k400 --gpus 8
Two nodes:     python 15_x3d_m_spawn_syncbn.py --data /data/k400 --gpus 8 --nodes 2 --node-rank {0,1} \
                   --master-addr 10.1.0.11
"""
import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from pytorchvideo.models.hub import x3d_m
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler, Subset
from torch.utils.tensorboard import SummaryWriter


class RepeatAugSampler(Sampler):
    """Each index appears `repeats` times per epoch, the copies land on different ranks."""

    def __init__(self, n, world, rank, repeats=2, seed=0):
        self.n, self.world, self.rank, self.repeats, self.seed = n, world, rank, repeats, seed
        self.epoch = 0
        self.num_samples = math.ceil(n * repeats / world)
        self.total = self.num_samples * world

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=g).repeat_interleave(self.repeats).tolist()
        order += order[: self.total - len(order)]
        return iter(order[self.rank:self.total:self.world])

    def __len__(self):
        return self.num_samples


class KineticsX3D(Dataset):
    def __init__(self, root, split, train, frames=16, rate=5, crop=224):
        with open(os.path.join(root, f"{split}.txt")) as f:
            self.items = [l.rsplit(" ", 1) for l in f.read().splitlines() if l]
        self.dir = os.path.join(root, split)
        self.train, self.frames, self.rate, self.crop = train, frames, rate, crop

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        for _ in range(10):
            rel, label = self.items[i]
            try:
                vr = VideoReader(os.path.join(self.dir, rel), ctx=cpu(0), num_threads=1)
                break
            except Exception:
                i = random.randrange(len(self.items))
        else:
            raise RuntimeError("decode retries exhausted")
        n, span = len(vr), self.frames * self.rate
        st = random.randint(0, max(0, n - span)) if self.train else max(0, n - span) // 2
        x = torch.from_numpy(vr.get_batch(np.minimum(np.arange(st, st + span, self.rate), n - 1)).asnumpy())
        x = x.permute(3, 0, 1, 2).float().div(255).sub(0.45).div(0.225)       # C T H W
        short = random.randint(256, 320) if self.train else 256
        x = F.interpolate(x, scale_factor=short / min(x.shape[-2:]), mode="bilinear", align_corners=False)
        h, w = x.shape[-2:]
        y0 = random.randint(0, h - self.crop) if self.train else (h - self.crop) // 2
        x0 = random.randint(0, w - self.crop) if self.train else (w - self.crop) // 2
        x = x[..., y0:y0 + self.crop, x0:x0 + self.crop]
        if self.train and random.random() < 0.5:
            x = x.flip(-1)
        return x, int(label)


def worker(local_rank, args):
    rank = args.node_rank * args.gpus + local_rank
    world = args.nodes * args.gpus
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method=f"tcp://{args.master_addr}:{args.master_port}",
                            world_size=world, rank=rank)
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    train_set = KineticsX3D(args.data, "train", True)
    val_set = KineticsX3D(args.data, "val", False)
    sampler = RepeatAugSampler(len(train_set), world, rank, repeats=args.repeats, seed=args.seed)
    # an epoch covers the dataset once in total, the repeats replace unique videos
    steps = len(train_set) // (args.batch_size * world)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=args.batch_size,
                            num_workers=args.workers, pin_memory=True)

    model = x3d_m(pretrained=False)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model.to(device), device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 128
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-5, nesterov=True)
    scaler = torch.cuda.amp.GradScaler()
    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        state = ckpt["model"]
        state = {(k[7:] if k.startswith("module.") else k): v for k, v in state.items()}
        model.module.load_state_dict(state)
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1

    total = args.epochs * steps
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        it_loader = iter(train_loader)
        for step in range(steps):
            clips, labels = next(it_loader)
            g_step = epoch * steps + step
            cur = lr * 0.5 * (1 + math.cos(math.pi * g_step / total))
            if g_step < args.warmup * steps:
                cur *= (g_step + 1) / (args.warmup * steps)
            for pg in optimizer.param_groups:
                pg["lr"] = cur
            clips, labels = clips.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(clips), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if writer is not None:
                    writer.add_scalar("train/loss", l.item(), g_step)
                    writer.add_scalar("train/lr", cur, g_step)
                    print(f"ep {epoch} {step}/{steps} loss {l.item():.4f} {time.time() - t0:.0f}s", flush=True)
        del it_loader

        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for clips, labels in val_loader:
                clips, labels = clips.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                acc[0] += (model.module(clips).argmax(1) == labels).sum()
                acc[1] += labels.numel()
        dist.all_reduce(acc)
        if rank == 0:
            top1 = (100 * acc[0] / acc[1]).item()
            writer.add_scalar("val/top1", top1, epoch)
            print(f"epoch {epoch} val top1 {top1:.2f}", flush=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"x3d_m_ep{epoch:03d}.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="/shared/runs/x3d_m")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29511)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--warmup", type=int, default=35)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", default="")
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    mp.spawn(worker, args=(args,), nprocs=args.gpus, join=True)
