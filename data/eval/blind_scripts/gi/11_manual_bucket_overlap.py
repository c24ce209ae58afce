"""
Data-parallel training without DDP: our own gradient bucketing with
communication/computation overlap.

Parameters are packed (in reverse registration order, roughly the order their
grads become ready) into ~25MB flat buckets. A post-accumulate-grad hook copies
each grad into its bucket; once a bucket is complete, and all earlier buckets
have been launched, its all-reduce is started asynchronously while backward
keeps running. After backward we wait on the handles and copy the averaged
gradients back.

    torchrun --nproc_per_node=8 11_manual_bucket_overlap.py --epochs 30
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
import timm


class OverlappedGradReducer:
    def __init__(self, model, bucket_mb=25):
        self.world = dist.get_world_size()
        params = [p for p in model.parameters() if p.requires_grad][::-1]
        cap = bucket_mb * 1024 * 1024
        self.buckets, cur, cur_bytes = [], [], 0
        for p in params:
            cur.append(p)
            cur_bytes += p.numel() * p.element_size()
            if cur_bytes >= cap:
                self.buckets.append(cur)
                cur, cur_bytes = [], 0
        if cur:
            self.buckets.append(cur)

        self.flat, self.offsets, self.where = [], {}, {}
        for b_idx, bucket in enumerate(self.buckets):
            n = sum(p.numel() for p in bucket)
            self.flat.append(torch.zeros(n, dtype=bucket[0].dtype, device=bucket[0].device))
            off = 0
            for p in bucket:
                self.offsets[p] = off
                self.where[p] = b_idx
                off += p.numel()
        self.reset()
        for p in params:
            p.register_post_accumulate_grad_hook(self._hook)

    def reset(self):
        self.pending = [len(b) for b in self.buckets]
        self.handles = [None] * len(self.buckets)
        self.next_to_launch = 0

    def _hook(self, p):
        b = self.where[p]
        off = self.offsets[p]
        self.flat[b][off:off + p.numel()].copy_(p.grad.view(-1))
        self.pending[b] -= 1
        # launch in bucket order so every rank issues the same sequence of collectives
        while self.next_to_launch < len(self.buckets) and self.pending[self.next_to_launch] == 0:
            i = self.next_to_launch
            self.flat[i].div_(self.world)
            self.handles[i] = dist.all_reduce(self.flat[i], async_op=True)
            self.next_to_launch += 1

    def finish(self):
        assert self.next_to_launch == len(self.buckets), "some gradients never arrived"
        for b_idx, h in enumerate(self.handles):
            h.wait()
            for p in self.buckets[b_idx]:
                off = self.offsets[p]
                p.grad.copy_(self.flat[b_idx][off:off + p.numel()].view_as(p.grad))
        self.reset()


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("--data", default="/data/tiny-imagenet-200")
    ap.add_argument("--model", default="convnext_tiny")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=96)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--bucket_mb", type=int, default=25)
    ap.add_argument("--out", default="out/bucket_overlap")
    return ap.parse_args()


def main():
    args = parse()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    norm = transforms.Normalize((0.480, 0.448, 0.398), (0.277, 0.269, 0.282))
    train_ds = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(64, scale=(0.35, 1)), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), norm]))
    val_ds = datasets.ImageFolder(os.path.join(args.data, "val_sorted"), transforms.Compose([
        transforms.ToTensor(), norm]))
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=256, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=4, pin_memory=True)

    model = timm.create_model(args.model, num_classes=200, drop_path_rate=0.1).to(device)
    with torch.no_grad():
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)
    reducer = OverlappedGradReducer(model, args.bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world * args.bs / 1024, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=opt.param_groups[0]["lr"],
                                                total_steps=args.epochs * len(train_dl), pct_start=0.1)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(reducer.buckets)} buckets, world {world}")

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        comm_wait = 0.0
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=False)
            loss.backward()
            tw = time.time()
            reducer.finish()
            comm_wait += time.time() - tw
            opt.step()
            sched.step()

        model.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                hits += torch.tensor([(model(x).argmax(1) == y).sum().item(), y.numel()], device=device)
        dist.all_reduce(hits)
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.3f} val_acc {(hits[0] / hits[1]).item():.4f} "
                  f"epoch {time.time() - t0:.0f}s, waited on comm {comm_wait:.1f}s")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "ckpt.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
