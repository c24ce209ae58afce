"""Pool-based active learning on CIFAR-10 with entropy sampling.

Each round: train ResNet-18 on the current labelled set (DDP), score a random
subset of the unlabelled pool with predictive entropy and move the top-k most
uncertain images into the labelled set.

    torchrun --nproc_per_node=4 al_entropy_cifar.py --rounds 10 --budget 1000
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
import torchvision
import torchvision.transforms as T


CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--out", default="./runs/al_entropy")
    p.add_argument("--init-labeled", type=int, default=1000)
    p.add_argument("--budget", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--pool-subsample", type=int, default=10000)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def build_model(num_classes=10):
    m = torchvision.models.resnet18(num_classes=num_classes)
    # small-image stem
    m.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    m.maxpool = nn.Identity()
    return m


def get_datasets(root, rank):
    train_tf = T.Compose([
        T.RandomCrop(32, padding=4),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        T.Normalize(CIFAR_MEAN, CIFAR_STD),
    ])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)])
    if rank == 0:
        torchvision.datasets.CIFAR10(root, train=True, download=True)
        torchvision.datasets.CIFAR10(root, train=False, download=True)
    dist.barrier()
    train = torchvision.datasets.CIFAR10(root, train=True, transform=train_tf)
    # same images without augmentation, used for scoring the pool
    pool = torchvision.datasets.CIFAR10(root, train=True, transform=test_tf)
    test = torchvision.datasets.CIFAR10(root, train=False, transform=test_tf)
    return train, pool, test


def train_round(model, loader, sampler, args, device, rank):
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                          weight_decay=args.wd, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        running, n = 0.0, 0
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += loss.item() * x.size(0)
            n += x.size(0)
        sched.step()
        if rank == 0 and (epoch + 1) % 10 == 0:
            print(f"  epoch {epoch + 1}/{args.epochs} loss {running / max(n, 1):.4f}")


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    total = torch.zeros(1, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        pred = model(x).argmax(1)
        correct += (pred == y).sum()
        total += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    return (correct / total).item()


@torch.no_grad()
def entropy_scores(model, dataset, indices, args, device):
    model.eval()
    loader = DataLoader(Subset(dataset, indices), batch_size=512,
                        shuffle=False, num_workers=args.workers, pin_memory=True)
    scores = []
    for x, _ in loader:
        probs = F.softmax(model(x.to(device)), dim=1)
        ent = -(probs * torch.log(probs + 1e-12)).sum(1)
        scores.append(ent.cpu())
    return torch.cat(scores)


def main():
    args = parse_args()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    set_seed(args.seed + rank)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    train_set, pool_set, test_set = get_datasets(args.data, rank)
    n_train = len(train_set)

    # initial labelled set: identical on every rank
    g = np.random.RandomState(args.seed)
    perm = g.permutation(n_train)
    labeled = perm[: args.init_labeled].tolist()
    unlabeled = perm[args.init_labeled:].tolist()

    test_sampler = DistributedSampler(test_set, shuffle=False)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler,
                             num_workers=args.workers, pin_memory=True)

    history = []
    for rnd in range(args.rounds + 1):
        t0 = time.time()
        model = build_model().to(device)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = DDP(model, device_ids=[local_rank])

        lab_set = Subset(train_set, labeled)
        sampler = DistributedSampler(lab_set, shuffle=True, seed=args.seed)
        loader = DataLoader(lab_set, batch_size=args.batch_size, sampler=sampler,
                            num_workers=args.workers, pin_memory=True, drop_last=True)
        train_round(model, loader, sampler, args, device, rank)
        acc = evaluate(model, test_loader, device)

        if rank == 0:
            print(f"[round {rnd}] labeled={len(labeled)} test_acc={acc:.4f} "
                  f"({time.time() - t0:.0f}s)")
            history.append({"round": rnd, "labeled": len(labeled), "acc": acc})
            torch.save({"model": model.module.state_dict(), "labeled": labeled,
                        "round": rnd}, os.path.join(args.out, f"round_{rnd}.pt"))
            with open(os.path.join(args.out, "history.json"), "w") as f:
                json.dump(history, f, indent=2)

        if rnd == args.rounds:
            break

        # score a random subset of the pool (full-pool scoring is too slow)
        candidates = random.sample(unlabeled, min(args.pool_subsample, len(unlabeled)))
        scores = entropy_scores(model.module, pool_set, candidates, args, device)
        top = torch.topk(scores, k=args.budget).indices.tolist()
        picked = [candidates[i] for i in top]
        picked_set = set(picked)
        labeled = labeled + picked
        unlabeled = [i for i in unlabeled if i not in picked_set]
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
