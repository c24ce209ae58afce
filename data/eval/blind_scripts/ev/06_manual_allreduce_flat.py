"""Hand-rolled bucketed gradient all-reduce (no DDP), used to study bucket size
vs. step time without DDP's overlap. Gradients are packed into flat fp32
buckets after backward, all-reduced bucket by bucket, and unpacked.

    torchrun --nproc_per_node=4 manual_allreduce_flat.py --bucket-mb 25
"""
import argparse
import csv
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


class FlatGradReducer:
    """Groups parameters into ~bucket_mb sized buckets (in reverse registration order,
    roughly the order gradients become ready) and all-reduces one flat buffer per bucket."""

    def __init__(self, params, bucket_mb=25.0, device="cuda:0", dtype=torch.float32):
        self.params = [p for p in params if p.requires_grad]
        self.world_size = dist.get_world_size()
        cap = int(bucket_mb * 1024 * 1024 / torch.tensor([], dtype=dtype).element_size())
        self.buckets, cur, cur_n = [], [], 0
        for p in reversed(self.params):
            if cur and cur_n + p.numel() > cap:
                self.buckets.append(cur)
                cur, cur_n = [], 0
            cur.append(p)
            cur_n += p.numel()
        if cur:
            self.buckets.append(cur)
        self.buffers = [torch.zeros(sum(p.numel() for p in b), device=device, dtype=dtype) for b in self.buckets]

    @torch.no_grad()
    def reduce(self):
        for bucket, buf in zip(self.buckets, self.buffers):
            off = 0
            for p in bucket:
                n = p.numel()
                if p.grad is None:
                    buf[off:off + n].zero_()
                else:
                    buf[off:off + n].copy_(p.grad.view(-1))
                off += n
            dist.all_reduce(buf)
            buf.div_(self.world_size)
            off = 0
            for p in bucket:
                n = p.numel()
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.copy_(buf[off:off + n].view_as(p))
                off += n

    def describe(self):
        return [sum(p.numel() for p in b) for b in self.buckets]


def build_model(num_classes):
    m = torchvision.models.resnet50(num_classes=num_classes, norm_layer=lambda c: nn.GroupNorm(32, c))
    return m


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/datasets/imagenet100")
    p.add_argument("--out", default="results/flat_reduce")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.2, help="for the global batch")
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--clip", type=float, default=5.0)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm]))
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=128,
                            num_workers=args.workers, pin_memory=True)

    model = build_model(len(train_set.classes)).to(device)
    with torch.no_grad():
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)

    reducer = FlatGradReducer(model.parameters(), bucket_mb=args.bucket_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd)
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_loader), pct_start=0.05)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(reducer.buckets)} buckets, sizes (numel): {reducer.describe()}")
        csv_f = open(os.path.join(args.out, f"timing_b{args.bucket_mb:g}_w{world}.csv"), "w", newline="")
        timing = csv.writer(csv_f)
        timing.writerow(["epoch", "step", "fwd_bwd_ms", "reduce_ms", "opt_ms", "loss"])

    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            ev[0].record()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            ev[1].record()
            reducer.reduce()
            ev[2].record()
            # grads are identical on all ranks after the reduce, so the clip is too
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            sched.step()
            ev[3].record()
            if rank == 0 and step % 50 == 0:
                torch.cuda.synchronize()
                timing.writerow([epoch, step, ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2]),
                                 ev[2].elapsed_time(ev[3]), loss.item()])
                csv_f.flush()

        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model(x).argmax(1)
                acc[0] += (pred == y).sum()
                acc[1] += y.numel()
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch}: top1 {100 * acc[0].item() / acc[1].item():.2f}", flush=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
        dist.barrier()

    if rank == 0:
        csv_f.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
