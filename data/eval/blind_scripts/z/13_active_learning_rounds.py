"""
Pool-based active learning on CIFAR-10 with DDP.

Round r:
  1. train a fresh ResNet-18 on the current labeled set (all GPUs)
  2. report test accuracy (counts all-reduced across ranks)
  3. score the whole unlabeled pool by predictive entropy (pool sharded across ranks),
     gather the scores, rank 0 picks the top-B most uncertain images and broadcasts them

    torchrun --nproc_per_node=4 13_active_learning_rounds.py --data ./data --rounds 10 --budget 2000
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./data")
    ap.add_argument("--out", default="./al_runs/entropy")
    ap.add_argument("--init-labeled", type=int, default=2000)
    ap.add_argument("--budget", type=int, default=2000, help="images queried per round")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def cifar_resnet18(num_classes=10):
    m = torchvision.models.resnet18(num_classes=num_classes)
    m.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    m.maxpool = nn.Identity()
    return m


MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])
test_tf = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])


def train_round(labeled_idx, train_aug, args, device, local_rank, rank):
    model = nn.SyncBatchNorm.convert_sync_batchnorm(cifar_resnet18()).to(device)
    model = DDP(model, device_ids=[local_rank])
    subset = Subset(train_aug, labeled_idx)
    sampler = DistributedSampler(subset, shuffle=True, seed=args.seed)
    loader = DataLoader(subset, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(loader))
    for epoch in range(args.epochs):
        model.train()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        if rank == 0 and (epoch + 1) % 20 == 0:
            print(f"    epoch {epoch + 1}/{args.epochs} loss {loss.item():.4f}", flush=True)
    return model


@torch.no_grad()
def test_accuracy(model, test_set, rank, world, device):
    model.eval()
    shard = Subset(test_set, list(range(rank, len(test_set), world)))
    loader = DataLoader(shard, batch_size=512, num_workers=4, pin_memory=True)
    stats = torch.zeros(2, device=device, dtype=torch.long)
    for x, y in loader:
        pred = model(x.to(device, non_blocking=True)).argmax(1)
        stats[0] += (pred == y.to(device)).sum()
        stats[1] += y.numel()
    dist.all_reduce(stats)
    return stats[0].item() / stats[1].item()


@torch.no_grad()
def score_pool(model, pool_set, unlabeled_idx, rank, world, device):
    """entropy of the softmax for every unlabeled image; returns (idx, score) from all ranks"""
    model.eval()
    my_idx = unlabeled_idx[rank::world]
    loader = DataLoader(Subset(pool_set, my_idx), batch_size=512, num_workers=4, pin_memory=True)
    scores = []
    for x, _ in loader:
        p = F.softmax(model(x.to(device, non_blocking=True)).float(), dim=1)
        scores.append(-(p * torch.log(p + 1e-12)).sum(1).cpu())
    local = list(zip(my_idx, torch.cat(scores).tolist())) if scores else []
    parts = [None] * world
    dist.all_gather_object(parts, local)
    return [item for part in parts for item in part]


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    # download once, the other ranks wait and then read the files from disk
    if rank == 0:
        torchvision.datasets.CIFAR10(args.data, train=True, download=True)
        torchvision.datasets.CIFAR10(args.data, train=False, download=True)
    dist.barrier()
    train_aug = torchvision.datasets.CIFAR10(args.data, train=True, transform=train_tf)
    pool_set = torchvision.datasets.CIFAR10(args.data, train=True, transform=test_tf)
    test_set = torchvision.datasets.CIFAR10(args.data, train=False, transform=test_tf)

    rng = np.random.RandomState(args.seed)  # same seed on every rank -> same initial labeled set
    perm = rng.permutation(len(train_aug))
    labeled = sorted(perm[: args.init_labeled].tolist())
    labeled_set = set(labeled)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    log = []
    for r in range(args.rounds + 1):
        t0 = time.time()
        if rank == 0:
            print(f"=== round {r}: {len(labeled)} labeled ===", flush=True)
        model = train_round(labeled, train_aug, args, device, local_rank, rank)
        acc = test_accuracy(model.module, test_set, rank, world, device)
        if rank == 0:
            print(f"round {r}: test acc {acc * 100:.2f}% ({time.time() - t0:.0f}s)", flush=True)
            log.append({"round": r, "n_labeled": len(labeled), "test_acc": acc})
            torch.save({"model": model.module.state_dict(), "labeled": labeled},
                       os.path.join(args.out, f"round{r:02d}.pt"))
            with open(os.path.join(args.out, "log.json"), "w") as f:
                json.dump(log, f, indent=1)
        if r == args.rounds:
            break

        unlabeled = [i for i in range(len(pool_set)) if i not in labeled_set]
        scored = score_pool(model.module, pool_set, unlabeled, rank, world, device)
        picked = [None]
        if rank == 0:
            scored.sort(key=lambda t: t[1], reverse=True)
            picked[0] = [i for i, _ in scored[: args.budget]]
            print(f"round {r}: queried {len(picked[0])} images, mean entropy "
                  f"{np.mean([s for _, s in scored[: args.budget]]):.3f}", flush=True)
        dist.broadcast_object_list(picked, src=0)
        labeled_set.update(picked[0])
        labeled = sorted(labeled_set)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
