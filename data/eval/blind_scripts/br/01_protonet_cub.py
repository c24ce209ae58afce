#!/usr/bin/env python
"""Prototypical Networks on CUB-200-2011 (Conv-4 backbone), multi-GPU.

Every GPU samples its own episodes; DDP averages the gradients, so one
optimizer step sees world_size episodes.

    torchrun --nproc_per_node=4 01_protonet_cub.py --data /data/CUB_200_2011
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
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision import transforms


def parse_args():
    p = argparse.ArgumentParser(description="ProtoNet / CUB")
    p.add_argument("--data", default="/data/CUB_200_2011")
    p.add_argument("--out", default="runs/protonet_cub")
    p.add_argument("--n-way", type=int, default=5)
    p.add_argument("--k-shot", type=int, default=5)
    p.add_argument("--n-query", type=int, default=16)
    p.add_argument("--train-way", type=int, default=20)
    p.add_argument("--episodes-per-epoch", type=int, default=100)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--val-episodes", type=int, default=600)
    p.add_argument("--test-episodes", type=int, default=2000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--step-size", type=int, default=40)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    )


class Conv4(nn.Module):
    def __init__(self, hid=64):
        super().__init__()
        self.net = nn.Sequential(conv_block(3, hid), conv_block(hid, hid),
                                 conv_block(hid, hid), conv_block(hid, hid))

    def forward(self, x):
        return self.net(x).flatten(1)


def read_cub(root):
    """Returns {class_id: [image paths]} from the official CUB metadata files."""
    with open(os.path.join(root, "images.txt")) as f:
        paths = dict(line.split() for line in f)
    with open(os.path.join(root, "image_class_labels.txt")) as f:
        labels = dict(line.split() for line in f)
    per_class = {}
    for img_id, rel in paths.items():
        per_class.setdefault(int(labels[img_id]), []).append(
            os.path.join(root, "images", rel))
    return per_class


class CUBSubset(Dataset):
    def __init__(self, per_class, classes, transform):
        self.items, self.labels = [], []
        for new_label, c in enumerate(classes):
            for path in sorted(per_class[c]):
                self.items.append(path)
                self.labels.append(new_label)
        self.transform = transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        img = Image.open(self.items[i]).convert("RGB")
        return self.transform(img), self.labels[i]


class EpisodeSampler(Sampler):
    """Yields index lists laid out as [n_per_class, n_way] (shot-major)."""

    def __init__(self, labels, n_episodes, n_way, n_per_class, seed):
        labels = np.asarray(labels)
        self.classes = np.unique(labels)
        self.index = {c: np.flatnonzero(labels == c) for c in self.classes}
        self.n_episodes, self.n_way, self.n_per_class = n_episodes, n_way, n_per_class
        self.rng = np.random.RandomState(seed)

    def __len__(self):
        return self.n_episodes

    def __iter__(self):
        for _ in range(self.n_episodes):
            chosen = self.rng.choice(self.classes, self.n_way, replace=False)
            cols = [self.rng.choice(self.index[c], self.n_per_class, replace=False)
                    for c in chosen]
            yield np.stack(cols, 1).reshape(-1).tolist()


def proto_logits(emb, n_way, k_shot):
    p = n_way * k_shot
    protos = emb[:p].view(k_shot, n_way, -1).mean(0)
    return -torch.cdist(emb[p:], protos).pow(2)


@torch.no_grad()
def evaluate(model, loader, n_way, k_shot, n_query, device):
    model.eval()
    accs = []
    labels = torch.arange(n_way, device=device).repeat(n_query)
    for images, _ in loader:
        logits = proto_logits(model(images.to(device, non_blocking=True)), n_way, k_shot)
        accs.append((logits.argmax(1) == labels).float().mean())
    accs = torch.stack(accs)
    stats = torch.stack([accs.sum(), (accs ** 2).sum(),
                         torch.tensor(float(accs.numel()), device=device)])
    dist.all_reduce(stats)
    n = stats[2]
    mean = stats[0] / n
    std = (stats[1] / n - mean ** 2).clamp_min(0).sqrt()
    model.train()
    return mean.item(), (1.96 * std / n.sqrt()).item()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    # different episodes on every GPU, same initial weights
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    per_class = read_cub(args.data)
    classes = sorted(per_class)
    random.shuffle(classes)
    train_cls, val_cls, test_cls = classes[:100], classes[100:150], classes[150:]

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(84), transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.4, 0.4, 0.4), transforms.ToTensor(), norm])
    test_tf = transforms.Compose([
        transforms.Resize(92), transforms.CenterCrop(84), transforms.ToTensor(), norm])

    train_set = CUBSubset(per_class, train_cls, train_tf)
    val_set = CUBSubset(per_class, val_cls, test_tf)
    test_set = CUBSubset(per_class, test_cls, test_tf)

    train_sampler = EpisodeSampler(train_set.labels, args.episodes_per_epoch, args.train_way,
                                   args.k_shot + args.n_query, seed=args.seed * 100 + rank)
    train_loader = DataLoader(train_set, batch_sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True)

    def episodic_loader(ds, n_episodes, seed):
        sampler = EpisodeSampler(ds.labels, n_episodes // world_size, args.n_way,
                                 args.k_shot + args.n_query, seed=seed + rank)
        return DataLoader(ds, batch_sampler=sampler, num_workers=args.workers,
                          pin_memory=True)

    model = DDP(Conv4().to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.step_size, gamma=0.5)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    best_acc = 0.0
    train_labels = torch.arange(args.train_way, device=device).repeat(args.n_query)
    for epoch in range(1, args.epochs + 1):
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for images, _ in train_loader:
            images = images.to(device, non_blocking=True)
            logits = proto_logits(model(images), args.train_way, args.k_shot)
            loss = F.cross_entropy(logits, train_labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach(),
                                     (logits.argmax(1) == train_labels).float().mean()])
        scheduler.step()
        dist.all_reduce(loss_sum)
        loss_sum /= world_size * len(train_loader)

        # fixed validation episodes so epochs are comparable
        val_acc, val_ci = evaluate(model, episodic_loader(val_set, args.val_episodes, 777),
                                   args.n_way, args.k_shot, args.n_query, device)
        if rank == 0:
            print(f"epoch {epoch:3d} loss {loss_sum[0]:.4f} train-acc {loss_sum[1]:.4f} "
                  f"val {100 * val_acc:.2f} +- {100 * val_ci:.2f} ({time.time() - t0:.0f}s)",
                  flush=True)
            state = {"epoch": epoch, "model": model.module.state_dict(),
                     "optimizer": optimizer.state_dict(), "val_acc": val_acc}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    ckpt = torch.load(os.path.join(args.out, "best.pt"), map_location="cpu")
    model.module.load_state_dict(ckpt["model"])
    test_acc, test_ci = evaluate(model, episodic_loader(test_set, args.test_episodes, 2024),
                                 args.n_way, args.k_shot, args.n_query, device)
    if rank == 0:
        print(f"test {args.n_way}-way {args.k_shot}-shot: "
              f"{100 * test_acc:.2f} +- {100 * test_ci:.2f} (best epoch {ckpt['epoch']})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
