"""Tiny-ImageNet training with loss-threshold hard-example selection.

After `--warmup-epochs` of normal training, only the samples of a batch whose
loss exceeds `ratio * (mean loss of the previous epoch)` are back-propagated
("selective backprop"): easy samples cost a forward pass but no backward.

    torchrun --nproc_per_node=8 12_loss_threshold_hard_examples.py --data /data/tiny-imagenet-200
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--arch", default="resnet34")
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--ratio", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.2, help="for a global batch of 512")
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--ckpt-dir", default="ckpt/tin_selective")
    return p


def make_model(arch, num_classes):
    m = torchvision.models.__dict__[arch](num_classes=num_classes)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def make_data(root, rank, world, batch_size, workers):
    mean, std = [0.480, 0.448, 0.398], [0.277, 0.269, 0.282]
    train_tf = T.Compose([T.RandomCrop(64, padding=8), T.RandomHorizontalFlip(),
                          T.TrivialAugmentWide(), T.ToTensor(), T.Normalize(mean, std)])
    val_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    # val/ was re-organised into class folders beforehand
    train = torchvision.datasets.ImageFolder(os.path.join(root, "train"), train_tf)
    val = torchvision.datasets.ImageFolder(os.path.join(root, "val"), val_tf)
    train_sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train, batch_size=batch_size, sampler=train_sampler, num_workers=workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val, range(rank, len(val), world)), batch_size=256, num_workers=workers,
                            pin_memory=True)
    return train_loader, val_loader, train_sampler, len(train.classes)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    res = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        res[0] += (model(x).argmax(1) == y).sum()
        res[1] += y.numel()
    dist.all_reduce(res)
    return (res[0] / res[1]).item()


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_loader, val_loader, train_sampler, num_classes = make_data(args.data, rank, world, args.batch_size,
                                                                     args.workers)
    model = make_model(args.arch, num_classes).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 512
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    iters = len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, epochs=args.epochs,
                                                    steps_per_epoch=iters, pct_start=0.1)

    threshold = None
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        stats = torch.zeros(3, device=device)  # loss sum, samples, samples back-propagated
        t0 = time.time()
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            per = F.cross_entropy(logits, y, reduction="none", label_smoothing=args.label_smoothing)
            stats[0] += per.detach().sum()
            stats[1] += y.numel()
            if threshold is not None and epoch >= args.warmup_epochs:
                hard = per.detach() > threshold
                if hard.sum() == 0:
                    scheduler.step()
                    continue
                loss = per[hard].mean()
                stats[2] += hard.sum()
            else:
                loss = per.mean()
                stats[2] += y.numel()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()

        dist.all_reduce(stats)
        epoch_mean = (stats[0] / stats[1]).item()
        threshold = args.ratio * epoch_mean
        acc = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch:3d} loss {epoch_mean:.4f} backprop {stats[2] / stats[1]:.2%} "
                  f"next_thr {threshold:.4f} val_acc {acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            os.makedirs(args.ckpt_dir, exist_ok=True)
            ckpt = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "threshold": threshold}
            torch.save(ckpt, os.path.join(args.ckpt_dir, "last.pt"))
            if acc > best:
                best = acc
                torch.save(ckpt, os.path.join(args.ckpt_dir, "best.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
