"""Least-confidence active learning on Fashion-MNIST (multi-GPU).

Follows the usual protocol of the AL literature: the model is re-initialised every
round and trained until it fits the labelled set (99% train accuracy), then the
unlabelled pool is scored with 1 - max_c p(c|x).

    torchrun --standalone --nproc_per_node=8 05_leastconf_fmnist.py --rounds 15
"""
import argparse
import csv
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="./data")
    p.add_argument("--save_dir", default="./checkpoints/fmnist_lc")
    p.add_argument("--init_size", type=int, default=500)
    p.add_argument("--budget", type=int, default=500)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--batch_size", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max_epochs", type=int, default=200)
    p.add_argument("--target_train_acc", type=float, default=0.99)
    p.add_argument("--seed", type=int, default=123)
    return p.parse_args()


class SmallCNN(nn.Module):
    def __init__(self, n_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.drop = nn.Dropout(0.3)
        self.fc1 = nn.Linear(64 * 7 * 7, 256)
        self.fc2 = nn.Linear(256, n_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.drop(F.relu(self.fc1(x.flatten(1))))
        return self.fc2(x)


def fit(model, dataset, labelled, args, device, rank, world_size, rnd):
    ds = Subset(dataset, labelled)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=2, pin_memory=True)
    # Adam lr scaled with sqrt of the number of workers
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world_size ** 0.5)
    epoch = 0
    for epoch in range(args.max_epochs):
        sampler.set_epoch(epoch)
        model.train()
        n_correct, n_seen = 0, 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            n_correct += (out.argmax(1) == y).sum().item()
            n_seen += y.size(0)
        train_acc = n_correct / max(n_seen, 1)
        if train_acc >= args.target_train_acc:
            break
    if rank == 0:
        print(f"  round {rnd}: stopped after {epoch + 1} epochs (train acc {train_acc:.3f})", flush=True)


@torch.no_grad()
def test(model, dataset, device, rank, world_size):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=1000, sampler=sampler, num_workers=2)
    model.eval()
    correct = torch.tensor(0.0, device=device)
    count = torch.tensor(0.0, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        correct += (model(x).argmax(1) == y).sum()
        count += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(count)
    return (correct / count).item()


@torch.no_grad()
def least_confidence(model, dataset, pool, device, rank, world_size):
    ds = Subset(dataset, pool)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(ds, batch_size=2000, sampler=sampler, num_workers=2)
    model.eval()
    conf = torch.cat([F.softmax(model(x.to(device)), 1).max(1).values for x, _ in loader])
    pos = torch.tensor(list(sampler), device=device)
    confs = [torch.empty_like(conf) for _ in range(world_size)]
    poss = [torch.empty_like(pos) for _ in range(world_size)]
    dist.all_gather(confs, conf)
    dist.all_gather(poss, pos)
    score = torch.full((len(pool),), float("inf"), device=device)
    score[torch.cat(poss)] = torch.cat(confs)
    return score  # low confidence = more informative


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.2860,), (0.3530,))])
    if rank == 0:
        datasets.FashionMNIST(args.root, train=True, download=True)
        datasets.FashionMNIST(args.root, train=False, download=True)
        os.makedirs(args.save_dir, exist_ok=True)
    dist.barrier()
    train_set = datasets.FashionMNIST(args.root, train=True, transform=tf)
    test_set = datasets.FashionMNIST(args.root, train=False, transform=tf)

    g = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(len(train_set), generator=g).tolist()
    labelled, pool = perm[:args.init_size], perm[args.init_size:]

    rows = []
    for rnd in range(args.rounds + 1):
        start = time.time()
        torch.manual_seed(args.seed + rnd)
        model = DDP(SmallCNN().to(device), device_ids=[local_rank])
        fit(model, train_set, labelled, args, device, rank, world_size, rnd)
        acc = test(model.module, test_set, device, rank, world_size)
        if rank == 0:
            rows.append((rnd, len(labelled), round(acc, 5), round(time.time() - start, 1)))
            print(f"round {rnd} labelled {len(labelled)} test acc {acc:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "labelled": labelled, "pool": pool},
                       os.path.join(args.save_dir, f"round{rnd}.pt"))
        if rnd == args.rounds:
            break

        score = least_confidence(model.module, train_set, pool, device, rank, world_size)
        pick = torch.topk(-score, args.budget).indices.tolist()
        pick_set = set(pick)
        labelled = labelled + [pool[j] for j in pick]
        pool = [p for j, p in enumerate(pool) if j not in pick_set]

    if rank == 0:
        with open(os.path.join(args.save_dir, "curve.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["round", "n_labelled", "test_acc", "seconds"])
            w.writerows(rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
