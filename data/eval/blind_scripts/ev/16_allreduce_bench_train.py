"""ViT-B/16 training run instrumented for communication accounting.

A thin wrapper around DDP's allreduce hook counts the bytes each rank puts on
the wire per iteration; step time is split into compute and exposed comm with
a periodic no_sync step. Results go to <out>/comm_stats.jsonl.

    torchrun --nproc_per_node=8 allreduce_bench_train.py --data /datasets/imagenet --bucket-mb 25
"""
import argparse
import contextlib
import json
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


class CountingState:
    def __init__(self, process_group=None):
        self.process_group = process_group
        self.bytes = 0
        self.buckets = 0


def counting_allreduce_hook(state, bucket):
    buf = bucket.buffer()
    state.bytes += buf.numel() * buf.element_size()
    state.buckets += 1
    return default_hooks.allreduce_hook(state.process_group, bucket)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="results/comm_accounting")
    p.add_argument("--bucket-mb", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-3, help="for global batch 4096")
    p.add_argument("--wd", type=float, default=0.3)
    p.add_argument("--probe-every", type=int, default=50, help="run a no_sync step every N steps")
    p.add_argument("--seed", type=int, default=-1, help="-1: draw one on rank 0 and share it")
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


def init_distributed():
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])


def shared_seed(seed):
    if seed < 0:
        seed = random.randint(0, 2 ** 31 - 1)
    t = torch.tensor([seed], dtype=torch.long, device="cuda")
    dist.broadcast(t, src=0)
    return int(t.item())


def timed_step(model, optimizer, x, y, sync=True):
    ctx = contextlib.nullcontext() if sync else model.no_sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    with ctx:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
    end.record()
    return loss, start, end


def main():
    args = get_args()
    rank, world, local_rank = init_distributed()
    seed = shared_seed(args.seed)
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(seed)

    norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    sampler = DistributedSampler(train_set, shuffle=True, seed=seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = torchvision.models.vit_b_16(num_classes=len(train_set.classes)).to(device)
    model = DDP(model, device_ids=[local_rank], bucket_cap_mb=args.bucket_mb)
    state = CountingState()
    model.register_comm_hook(state, counting_allreduce_hook)

    lr = args.lr * args.batch_size * world / 4096
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.wd, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=args.epochs * len(loader),
                                                pct_start=0.1)

    out_f = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        out_f = open(os.path.join(args.out, "comm_stats.jsonl"), "a")
        print(f"seed {seed} world {world} bucket {args.bucket_mb}MB lr {lr:.2e}", flush=True)

    step = 0
    sync_ms, nosync_ms = [], []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            probe = step % args.probe_every == args.probe_every - 1
            bytes_before = state.bytes
            if probe:
                # same batch twice: once without the all-reduce (compute only), then the real step
                _, s0, e0 = timed_step(model, optimizer, x, y, sync=False)
            loss, s1, e1 = timed_step(model, optimizer, x, y, sync=True)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            sched.step()
            step += 1
            if probe:
                torch.cuda.synchronize()
                nosync_ms.append(s0.elapsed_time(e0))
                sync_ms.append(s1.elapsed_time(e1))
                rec = {"step": step, "loss": loss.item(), "bytes": state.bytes - bytes_before,
                       "fwd_bwd_ms": nosync_ms[-1], "fwd_bwd_allreduce_ms": sync_ms[-1],
                       "exposed_comm_ms": sync_ms[-1] - nosync_ms[-1]}
                if out_f is not None:
                    out_f.write(json.dumps(rec) + "\n")
                    out_f.flush()

        if rank == 0:
            n = max(1, len(sync_ms))
            print(f"epoch {epoch}: mean step {sum(sync_ms) / n:.1f}ms, compute {sum(nosync_ms) / n:.1f}ms, "
                  f"{state.bytes / max(1, step) / 2 ** 20:.1f} MiB/step", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "seed": seed},
                       os.path.join(args.out, "vit_b16_last.pt"))
        dist.barrier()

    if out_f is not None:
        out_f.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
