#!/usr/bin/env python
"""ResNet-50 ImageNet training for preemptible (spot) instances.

The job is started with torchrun and relies on --max-restarts: after a worker
failure or a preemption every worker is restarted and continues from the last
complete checkpoint in --ckpt-dir (which lives on the shared filesystem).
"""
import argparse
import math
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

_STOP_REQUESTED = False


def _on_sigterm(signum, frame):
    global _STOP_REQUESTED
    _STOP_REQUESTED = True


def parse_args():
    p = argparse.ArgumentParser(description="ResNet ImageNet (fault tolerant)")
    p.add_argument("--data", required=True, help="ImageNet root with train/ and val/")
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--base-lr", type=float, default=0.1, help="lr for a global batch of 256")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--ckpt-dir", default="/mnt/shared/ckpt/resnet50")
    p.add_argument("--save-every", type=int, default=1000, help="optimizer steps")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start in the middle of an epoch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start_index = 0

    def __iter__(self):
        indices = list(super().__iter__())
        return iter(indices[self.start_index:])

    def __len__(self):
        return self.num_samples - self.start_index


def build_loaders(args):
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        normalize,
    ])
    val_tf = transforms.Compose([
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        normalize,
    ])
    train_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)

    train_sampler = ResumableDistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=False)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, train_sampler


def save_checkpoint(state, ckpt_dir, step):
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, f"step_{step:08d}.pt")
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)
    with open(os.path.join(ckpt_dir, "latest.tmp"), "w") as f:
        f.write(os.path.basename(path))
    os.replace(os.path.join(ckpt_dir, "latest.tmp"), os.path.join(ckpt_dir, "latest"))


def load_latest(ckpt_dir):
    marker = os.path.join(ckpt_dir, "latest")
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        name = f.read().strip()
    return torch.load(os.path.join(ckpt_dir, name), map_location="cpu")


def stop_everywhere(device):
    flag = torch.tensor([1.0 if _STOP_REQUESTED else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss sum, correct, count
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(images)
        stats[0] += F.cross_entropy(out.float(), target, reduction="sum")
        stats[1] += (out.argmax(1) == target).sum()
        stats[2] += target.numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = parse_args()
    signal.signal(signal.SIGTERM, _on_sigterm)

    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    train_loader, val_loader, train_sampler = build_loaders(args)
    steps_per_epoch = len(train_loader)

    model = torchvision.models.__dict__[args.arch]()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)

    global_batch = args.batch_size * world_size
    lr = args.base_lr * global_batch / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = args.warmup_epochs * steps_per_epoch

    def lr_lambda(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, start_batch, global_step, best_acc = 0, 0, 0, 0.0
    ckpt = load_latest(args.ckpt_dir)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, start_batch = ckpt["epoch"], ckpt["batch_in_epoch"]
        global_step, best_acc = ckpt["global_step"], ckpt["best_acc"]
        if rank == 0:
            print(f"resumed from step {global_step} (epoch {start_epoch}, batch {start_batch})")
        del ckpt

    model = DDP(model, device_ids=[args.local_rank])
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    def make_state(epoch, batch_in_epoch):
        return {
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "epoch": epoch,
            "batch_in_epoch": batch_in_epoch,
            "global_step": global_step,
            "best_acc": best_acc,
            "world_size": world_size,
        }

    preempted = False
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train_sampler.start_index = start_batch * args.batch_size if epoch == start_epoch else 0
        model.train()
        t0 = time.time()
        for i, (images, target) in enumerate(train_loader, start=start_batch if epoch == start_epoch else 0):
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(images), target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            global_step += 1

            if rank == 0 and global_step % args.log_every == 0:
                ips = args.log_every * global_batch / (time.time() - t0)
                print(f"ep {epoch} it {i + 1}/{steps_per_epoch} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.4f} img/s {ips:.0f}", flush=True)
                t0 = time.time()

            stop = stop_everywhere(device)
            if stop or global_step % args.save_every == 0:
                if rank == 0:
                    save_checkpoint(make_state(epoch, i + 1), args.ckpt_dir, global_step)
                dist.barrier()
            if stop:
                preempted = True
                break
        if preempted:
            break

        start_batch = 0
        val_loss, val_acc = evaluate(model, val_loader, device)
        best_acc = max(best_acc, val_acc)
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f} val_acc {val_acc:.4f} best {best_acc:.4f}")
            save_checkpoint(make_state(epoch + 1, 0), args.ckpt_dir, global_step)
        dist.barrier()

    if rank == 0:
        print("stopping after SIGTERM" if preempted else "training finished")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
