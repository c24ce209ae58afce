#!/usr/bin/env python3
"""Margin-based active learning on SVHN.

    torchrun --standalone --nproc_per_node=8 08_margin_svhn.py --data /data/svhn --rounds 10
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms
from torchvision.models import resnet18

log = logging.getLogger(__name__)


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/svhn")
    p.add_argument("--work_dir", default="./work/svhn_margin")
    p.add_argument("--init_size", type=int, default=1000)
    p.add_argument("--query_size", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--bs", type=int, default=256, help="global batch size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--num_workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=2024)
    return p.parse_args()


def make_model():
    m = resnet18(num_classes=10)
    m.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    m.maxpool = nn.Identity()
    return nn.SyncBatchNorm.convert_sync_batchnorm(m)


def run_epoch(model, loader, opt, sched, device):
    model.train()
    stats = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        stats[0] += loss.detach() * y.size(0)
        stats[1] += (logits.argmax(1) == y).sum()
        stats[2] += y.size(0)
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    stats = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        stats[0] += (net(x).argmax(1) == y).sum()
        stats[1] += y.size(0)
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


@torch.no_grad()
def query_margin(net, dataset, pool, k, args, device, rank, world):
    """Score our slice of the pool, gather all slices, return the k smallest margins."""
    my_pool = pool[rank::world]
    loader = DataLoader(Subset(dataset, my_pool), batch_size=1024, shuffle=False,
                        num_workers=args.num_workers, pin_memory=True)
    net.eval()
    margins = []
    for x, _ in loader:
        p = F.softmax(net(x.to(device, non_blocking=True)), dim=1)
        top2 = torch.topk(p, 2, dim=1).values
        margins.append(top2[:, 0] - top2[:, 1])
    margins = torch.cat(margins)
    ids = torch.tensor(my_pool, device=device, dtype=torch.long)

    gathered_m = [torch.empty_like(margins) for _ in range(world)]
    gathered_i = [torch.empty_like(ids) for _ in range(world)]
    dist.all_gather(gathered_m, margins)
    dist.all_gather(gathered_i, ids)
    margins, ids = torch.cat(gathered_m), torch.cat(gathered_i)
    return ids[torch.argsort(margins)[:k]].tolist()


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    mean, std = (0.4377, 0.4438, 0.4728), (0.198, 0.201, 0.197)
    train_tf = transforms.Compose([transforms.RandomCrop(32, padding=2), transforms.ToTensor(),
                                   transforms.Normalize(mean, std)])
    eval_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    if rank == 0:
        for split in ("train", "test"):
            datasets.SVHN(args.data, split=split, download=True)
        os.makedirs(args.work_dir, exist_ok=True)
    dist.barrier()
    train_set = datasets.SVHN(args.data, split="train", transform=train_tf)
    query_set = datasets.SVHN(args.data, split="train", transform=eval_tf)
    test_set = datasets.SVHN(args.data, split="test", transform=eval_tf)

    rng = np.random.default_rng(args.seed)
    perm = rng.permutation(len(train_set))
    labelled = perm[:args.init_size].tolist()
    pool = sorted(perm[args.init_size:].tolist())

    test_loader = DataLoader(test_set, batch_size=1024, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=args.num_workers, pin_memory=True)

    for rnd in range(args.rounds + 1):
        t0 = time.time()
        torch.manual_seed(args.seed + rnd)
        model = DDP(make_model().to(device), device_ids=[local_rank])
        train_sub = Subset(train_set, labelled)
        sampler = DistributedSampler(train_sub, shuffle=True, seed=args.seed)
        loader = DataLoader(train_sub, batch_size=args.bs // world, sampler=sampler,
                            num_workers=args.num_workers, pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(loader))
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            tr_loss, tr_acc = run_epoch(model, loader, opt, sched, device)
        acc = evaluate(model.module, test_loader, device)
        log.info("round %d | labelled %d | train loss %.3f acc %.3f | test acc %.4f | %.0fs",
                 rnd, len(labelled), tr_loss, tr_acc, acc, time.time() - t0)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "labelled": labelled, "round": rnd},
                       os.path.join(args.work_dir, f"round_{rnd}.pth"))
        if rnd == args.rounds:
            break

        picked = query_margin(model.module, query_set, pool, args.query_size, args, device, rank, world)
        picked_set = set(picked)
        labelled += picked
        pool = [i for i in pool if i not in picked_set]

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
