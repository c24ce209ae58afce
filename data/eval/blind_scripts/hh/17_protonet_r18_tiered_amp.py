#!/usr/bin/env python3
"""ProtoNet with a torchvision ResNet-18 on tieredImageNet, mixed precision, multi-GPU.

    torchrun --nproc_per_node=8 17_protonet_r18_tiered_amp.py --root /data/tiered_imagenet \
        --out runs/tiered_r18_proto --shot 5
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torchvision import transforms

logger = logging.getLogger("tiered_r18")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/tiered_imagenet")
    ap.add_argument("--out", default="runs/tiered_r18_proto")
    ap.add_argument("--way", type=int, default=5)
    ap.add_argument("--train-way", type=int, default=10)
    ap.add_argument("--shot", type=int, default=5)
    ap.add_argument("--query", type=int, default=15)
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("--episodes", type=int, default=2000, help="per epoch over all GPUs")
    ap.add_argument("--val-episodes", type=int, default=1000, help="over all GPUs")
    ap.add_argument("--eval-freq", type=int, default=5)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--wd", type=float, default=5e-4)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--amp", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class EpisodeSampler:
    def __init__(self, targets, n_episodes, way, per_class, seed):
        targets = np.asarray(targets)
        self.where = [np.flatnonzero(targets == c) for c in range(targets.max() + 1)]
        self.n_episodes, self.way, self.per_class = n_episodes, way, per_class
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return self.n_episodes

    def __iter__(self):
        for _ in range(self.n_episodes):
            classes = self.rng.choice(len(self.where), self.way, replace=False)
            idx = np.stack([self.rng.choice(self.where[c], self.per_class, replace=False) for c in classes], 1)
            yield idx.reshape(-1).tolist()


def make_loader(root, split, train, n_episodes, way, per_class, seed, workers):
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    if train:
        tf = transforms.Compose([transforms.RandomResizedCrop(84, scale=(0.25, 1.0)), transforms.RandomHorizontalFlip(),
                                 transforms.ColorJitter(0.3, 0.3, 0.3), transforms.ToTensor(), norm])
    else:
        tf = transforms.Compose([transforms.Resize(92), transforms.CenterCrop(84), transforms.ToTensor(), norm])
    ds = torchvision.datasets.ImageFolder(os.path.join(root, split), transform=tf)
    sampler = EpisodeSampler(ds.targets, n_episodes, way, per_class, seed)
    return DataLoader(ds, batch_sampler=sampler, num_workers=workers, pin_memory=True, persistent_workers=True)


def build_backbone():
    net = torchvision.models.resnet18(weights=None)
    # 84x84 inputs: keep more resolution in the stem
    net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    net.maxpool = nn.Identity()
    net.fc = nn.Identity()
    return net


def proto_logits(z, way, shot):
    z = z.float()
    protos = z[: way * shot].view(shot, way, -1).mean(0)
    return -torch.cdist(z[way * shot:], protos).pow(2) / z.size(1)


@torch.no_grad()
def evaluate(model, loader, args, device):
    model.eval()
    y = torch.arange(args.way, device=device).repeat(args.query)
    total = torch.zeros(3, device=device, dtype=torch.float64)
    for x, _ in loader:
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            z = model(x.to(device, non_blocking=True))
        acc = (proto_logits(z, args.way, args.shot).argmax(1) == y).double().mean()
        total += torch.stack([acc, acc * acc, torch.ones_like(acc)])
    dist.all_reduce(total)
    mean = total[0] / total[2]
    ci = 1.96 * torch.sqrt((total[1] / total[2] - mean ** 2).clamp(min=0) / total[2])
    return mean.item(), ci.item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True

    train_loader = make_loader(args.root, "train", True, args.episodes // world, args.train_way,
                               args.shot + args.query, seed=args.seed * 10007 + rank, workers=args.workers)
    val_loader = make_loader(args.root, "val", False, args.val_episodes // world, args.way,
                             args.shot + args.query, seed=777 + rank, workers=args.workers)

    model = DDP(build_backbone().to(device), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[30, 60, 80], gamma=0.1)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    y_train = torch.arange(args.train_way, device=device).repeat(args.query)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_acc = 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0 = time.time()
        meter = torch.zeros(3, device=device)
        for x, _ in train_loader:
            x = x.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                z = model(x)
            logits = proto_logits(z, args.train_way, args.shot)
            loss = F.cross_entropy(logits, y_train)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            meter += torch.stack([loss.detach(), (logits.argmax(1) == y_train).float().mean(), torch.ones_like(loss)])
        scheduler.step()
        dist.all_reduce(meter)
        logger.info("epoch %d loss %.4f acc %.4f lr %.4f %.0fs", epoch, (meter[0] / meter[2]).item(),
                    (meter[1] / meter[2]).item(), scheduler.get_last_lr()[0], time.time() - t0)

        if rank == 0:
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict()}, os.path.join(args.out, "last.pth"))
            if epoch % args.eval_freq == 0 or epoch == args.epochs:
                val_acc, val_ci = evaluate(model.module, val_loader, args, device)
                logger.info("epoch %d val %.2f +- %.2f", epoch, 100 * val_acc, 100 * val_ci)
                if val_acc > best_acc:
                    best_acc = val_acc
                    torch.save({"epoch": epoch, "model": model.module.state_dict()},
                               os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
