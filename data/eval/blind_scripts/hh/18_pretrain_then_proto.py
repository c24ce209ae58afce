#!/usr/bin/env python3
"""Two-stage few-shot training on miniImageNet in one job:

  stage 1: 64-way classification pre-training (DistributedSampler, SyncBatchNorm)
  stage 2: episodic ProtoNet fine-tuning of the same encoder; several episodes are
           accumulated per optimiser step with DDP.no_sync()

    torchrun --nproc_per_node=4 18_pretrain_then_proto.py --root /data/miniImageNet --wandb
"""
import argparse
import contextlib
import copy
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/miniImageNet", help="ImageFolder layout: train/ val/")
    p.add_argument("--out", default="runs/two_stage")
    p.add_argument("--pre-epochs", type=int, default=90)
    p.add_argument("--pre-batch", type=int, default=128, help="per GPU")
    p.add_argument("--pre-lr", type=float, default=0.1)
    p.add_argument("--meta-epochs", type=int, default=40)
    p.add_argument("--episodes", type=int, default=1000, help="per epoch, summed over GPUs")
    p.add_argument("--accum", type=int, default=4, help="episodes per optimiser step on each GPU")
    p.add_argument("--meta-lr", type=float, default=1e-3)
    p.add_argument("--way", type=int, default=5)
    p.add_argument("--shot", type=int, default=1)
    p.add_argument("--query", type=int, default=15)
    p.add_argument("--val-episodes", type=int, default=800)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--wandb", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


NORM = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
TRAIN_TF = transforms.Compose([transforms.RandomResizedCrop(84), transforms.RandomHorizontalFlip(),
                               transforms.ColorJitter(0.4, 0.4, 0.4), transforms.ToTensor(), NORM])
TEST_TF = transforms.Compose([transforms.Resize(92), transforms.CenterCrop(84), transforms.ToTensor(), NORM])


class Episodes:
    def __init__(self, targets, n, way, per, seed):
        t = np.asarray(targets)
        self.pools = [np.flatnonzero(t == c) for c in range(t.max() + 1)]
        self.n, self.way, self.per = n, way, per
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return self.n

    def __iter__(self):
        for _ in range(self.n):
            cls = self.rng.choice(len(self.pools), self.way, replace=False)
            yield np.stack([self.rng.choice(self.pools[c], self.per, replace=False) for c in cls], 1).ravel().tolist()


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.MaxPool2d(2))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(block(3, 64), block(64, 128), block(128, 256), block(256, 512))
        self.dim = 512

    def forward(self, x):
        return self.body(x).mean((2, 3))


class Classifier(nn.Module):
    def __init__(self, encoder, n_classes):
        super().__init__()
        self.encoder = encoder
        self.fc = nn.Linear(encoder.dim, n_classes)

    def forward(self, x):
        return self.fc(self.encoder(x))


def episode_logits(z, way, shot):
    protos = z[: way * shot].view(shot, way, -1).mean(0)
    return -torch.cdist(z[way * shot:], protos).pow(2) / 64.0


@torch.no_grad()
def fewshot_val(encoder, loader, args, device):
    encoder.eval()
    y = torch.arange(args.way, device=device).repeat(args.query)
    s = torch.zeros(2, device=device)
    for x, _ in loader:
        logits = episode_logits(encoder(x.to(device, non_blocking=True)), args.way, args.shot)
        s += torch.stack([(logits.argmax(1) == y).float().mean(), torch.ones((), device=device)])
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    main_proc = rank == 0
    if main_proc:
        os.makedirs(args.out, exist_ok=True)
        if args.wandb:
            wandb.init(project="fewshot-two-stage", config=vars(args))

    train_set = datasets.ImageFolder(os.path.join(args.root, "train"), TRAIN_TF)
    val_set = datasets.ImageFolder(os.path.join(args.root, "val"), TEST_TF)
    val_loader = DataLoader(val_set, num_workers=args.workers, pin_memory=True,
                            batch_sampler=Episodes(val_set.targets, args.val_episodes // world, args.way,
                                                   args.shot + args.query, seed=99 + rank))

    # ---------------- stage 1: classification pre-training ----------------
    encoder = nn.SyncBatchNorm.convert_sync_batchnorm(Encoder()).to(dev)
    clf = DDP(Classifier(encoder, len(train_set.classes)).to(dev), device_ids=[local_rank])
    pre_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    pre_loader = DataLoader(train_set, batch_size=args.pre_batch, sampler=pre_sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True, persistent_workers=True)
    # linear scaling from the single-GPU recipe (lr 0.1 at batch 128)
    opt = torch.optim.SGD(clf.parameters(), lr=args.pre_lr * world, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.pre_epochs)
    for epoch in range(args.pre_epochs):
        pre_sampler.set_epoch(epoch)
        clf.train()
        t0 = time.time()
        m = torch.zeros(3, device=dev)
        for x, y in pre_loader:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            out = clf(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            m += torch.stack([loss.detach() * y.numel(), (out.argmax(1) == y).sum().float(),
                              torch.tensor(float(y.numel()), device=dev)])
        sched.step()
        dist.all_reduce(m)
        va = fewshot_val(encoder, val_loader, args, dev)
        if main_proc:
            print(f"[pre {epoch}] loss {(m[0] / m[2]).item():.3f} acc {(m[1] / m[2]).item():.3f} "
                  f"5w{args.shot}s val {va:.4f} {time.time() - t0:.0f}s", flush=True)
            if args.wandb:
                wandb.log({"pre/loss": (m[0] / m[2]).item(), "pre/val_fewshot": va})
            torch.save(clf.module.state_dict(), os.path.join(args.out, "pretrain_last.pth"))
    dist.barrier()
    # fresh parameters for the second wrapper, so no hook of the first DDP is left on them
    encoder = copy.deepcopy(clf.module.encoder)
    del clf, opt, sched

    # ---------------- stage 2: episodic fine-tuning, encoder only ----------------
    proto = DDP(encoder, device_ids=[local_rank])
    opt = torch.optim.Adam(proto.parameters(), lr=args.meta_lr)
    steps_per_epoch = args.episodes // (world * args.accum)
    ep_sampler = Episodes(train_set.targets, steps_per_epoch * args.accum, args.way, args.shot + args.query,
                          seed=args.seed * 7 + 1 + rank)
    ep_loader = DataLoader(train_set, batch_sampler=ep_sampler, num_workers=args.workers, pin_memory=True)
    y = torch.arange(args.way, device=dev).repeat(args.query)
    best = 0.0
    for epoch in range(args.meta_epochs):
        proto.train()
        m = torch.zeros(2, device=dev)
        opt.zero_grad(set_to_none=True)
        for i, (x, _) in enumerate(ep_loader):
            last_of_step = (i + 1) % args.accum == 0
            ctx = proto.no_sync() if not last_of_step else contextlib.nullcontext()
            with ctx:
                logits = episode_logits(proto(x.to(dev, non_blocking=True)), args.way, args.shot)
                loss = F.cross_entropy(logits, y) / args.accum
                loss.backward()
            if last_of_step:
                opt.step()
                opt.zero_grad(set_to_none=True)
            m += torch.stack([loss.detach() * args.accum, torch.ones((), device=dev)])
        dist.all_reduce(m)
        va = fewshot_val(proto.module, val_loader, args, dev)
        if main_proc:
            print(f"[meta {epoch}] loss {(m[0] / m[1]).item():.4f} val {va:.4f}", flush=True)
            if args.wandb:
                wandb.log({"meta/loss": (m[0] / m[1]).item(), "meta/val_fewshot": va})
            if va > best:
                best = va
                torch.save(proto.module.state_dict(), os.path.join(args.out, "encoder_best.pth"))
    if main_proc and args.wandb:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
