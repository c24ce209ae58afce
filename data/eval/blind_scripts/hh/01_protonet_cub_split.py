#!/usr/bin/env python3
"""Prototypical Networks on CUB-200-2011, multi-GPU.

Each GPU samples its own episodes and DDP averages the gradients, so one
optimisation step sees world_size episodes. The 200 bird classes are split
into 100 / 50 / 50 meta-train / meta-val / meta-test classes.

    torchrun --nproc_per_node=4 01_protonet_cub_split.py --data-root /data/CUB_200_2011
"""
import argparse
import json
import logging
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

logger = logging.getLogger("protonet_cub")


def parse_args():
    p = argparse.ArgumentParser(description="ProtoNet on CUB")
    p.add_argument("--data-root", default="/data/CUB_200_2011")
    p.add_argument("--out-dir", default="runs/protonet_cub")
    p.add_argument("--n-way", type=int, default=5)
    p.add_argument("--n-shot", type=int, default=5)
    p.add_argument("--n-query", type=int, default=16)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--episodes-per-epoch", type=int, default=400, help="summed over all GPUs")
    p.add_argument("--val-episodes", type=int, default=600, help="summed over all GPUs")
    p.add_argument("--test-episodes", type=int, default=2000, help="summed over all GPUs")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--step-size", type=int, default=40)
    p.add_argument("--gamma", type=float, default=0.5)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--n-train-classes", type=int, default=100)
    p.add_argument("--n-val-classes", type=int, default=50)
    return p.parse_args()


def setup_dist():
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return rank, world_size, local_rank


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def split_classes(image_dir, n_train, n_val):
    classes = sorted(os.listdir(image_dir))
    random.shuffle(classes)
    return classes[:n_train], classes[n_train:n_train + n_val], classes[n_train + n_val:]


class CUBImages(Dataset):
    def __init__(self, image_dir, classes, transform):
        self.paths, self.labels = [], []
        for label, cls in enumerate(classes):
            cls_dir = os.path.join(image_dir, cls)
            for fname in sorted(os.listdir(cls_dir)):
                self.paths.append(os.path.join(cls_dir, fname))
                self.labels.append(label)
        self.transform = transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(self.paths[i]).convert("RGB")
        return self.transform(img), self.labels[i]


class EpisodeSampler(Sampler):
    """Yields n_episodes index lists of n_way * n_per_class images.

    Layout is [n_per_class, n_way] flattened, so the label of position i is i % n_way.
    """

    def __init__(self, labels, n_episodes, n_way, n_per_class, seed):
        labels = np.asarray(labels)
        self.class_idx = [np.flatnonzero(labels == c) for c in np.unique(labels)]
        self.n_episodes = n_episodes
        self.n_way = n_way
        self.n_per_class = n_per_class
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return self.n_episodes

    def __iter__(self):
        for _ in range(self.n_episodes):
            classes = self.rng.choice(len(self.class_idx), self.n_way, replace=False)
            batch = [self.rng.choice(self.class_idx[c], self.n_per_class, replace=False) for c in classes]
            yield np.stack(batch, axis=1).reshape(-1).tolist()


def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    )


class Conv4(nn.Module):
    def __init__(self, hid=64):
        super().__init__()
        self.encoder = nn.Sequential(
            conv_block(3, hid), conv_block(hid, hid), conv_block(hid, hid), conv_block(hid, hid)
        )

    def forward(self, x):
        return self.encoder(x).flatten(1)


def proto_logits(emb, n_way, n_shot):
    support, query = emb[: n_way * n_shot], emb[n_way * n_shot:]
    protos = support.reshape(n_shot, n_way, -1).mean(0)
    return -torch.cdist(query, protos).pow(2)


def build_transforms(train):
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    if train:
        return transforms.Compose([
            transforms.RandomResizedCrop(84, scale=(0.5, 1.0)),
            transforms.RandomHorizontalFlip(),
            transforms.ColorJitter(0.4, 0.4, 0.4),
            transforms.ToTensor(),
            norm,
        ])
    return transforms.Compose([
        transforms.Resize(96),
        transforms.CenterCrop(84),
        transforms.ToTensor(),
        norm,
    ])


def episodic_loader(image_dir, classes, train, n_episodes, args, seed):
    ds = CUBImages(image_dir, classes, build_transforms(train))
    sampler = EpisodeSampler(ds.labels, n_episodes, args.n_way, args.n_shot + args.n_query, seed)
    return DataLoader(ds, batch_sampler=sampler, num_workers=args.workers, pin_memory=True)


def train_one_epoch(model, loader, optimizer, args, device):
    model.train()
    labels = torch.arange(args.n_way, device=device).repeat(args.n_query)
    stats = torch.zeros(3, device=device)
    for images, _ in loader:
        images = images.to(device, non_blocking=True)
        logits = proto_logits(model(images), args.n_way, args.n_shot)
        loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        acc = (logits.argmax(1) == labels).float().mean()
        stats += torch.stack([loss.detach(), acc, torch.ones_like(acc)])
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


@torch.no_grad()
def evaluate(model, loader, args, device):
    model.eval()
    labels = torch.arange(args.n_way, device=device).repeat(args.n_query)
    stats = torch.zeros(3, device=device, dtype=torch.float64)
    for images, _ in loader:
        images = images.to(device, non_blocking=True)
        logits = proto_logits(model(images), args.n_way, args.n_shot)
        acc = (logits.argmax(1) == labels).double().mean()
        stats += torch.stack([acc, acc * acc, torch.ones_like(acc)])
    dist.all_reduce(stats)
    mean = stats[0] / stats[2]
    std = (stats[1] / stats[2] - mean * mean).clamp_min(0).sqrt()
    return mean.item(), (1.96 * std / stats[2].sqrt()).item()


def main():
    args = parse_args()
    rank, world_size, local_rank = setup_dist()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s [%(levelname)s] %(message)s",
    )

    # every GPU should draw different episodes
    seed_everything(args.seed + rank)

    image_dir = os.path.join(args.data_root, "images")
    train_cls, val_cls, test_cls = split_classes(image_dir, args.n_train_classes, args.n_val_classes)
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "split.json"), "w") as f:
            json.dump({"train": train_cls, "val": val_cls, "test": test_cls}, f, indent=1)
        logger.info("classes: %d train / %d val / %d test", len(train_cls), len(val_cls), len(test_cls))

    train_loader = episodic_loader(image_dir, train_cls, True, args.episodes_per_epoch // world_size, args,
                                   seed=args.seed * 1000 + rank)
    val_loader = episodic_loader(image_dir, val_cls, False, args.val_episodes // world_size, args,
                                 seed=args.seed * 1000 + 100 + rank)

    model = Conv4().to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.step_size, gamma=args.gamma)

    best_acc, best_path = 0.0, os.path.join(args.out_dir, "best.pth")
    for epoch in range(1, args.epochs + 1):
        t0 = time.time()
        loss, train_acc = train_one_epoch(model, train_loader, optimizer, args, device)
        scheduler.step()
        val_acc, val_ci = evaluate(model, val_loader, args, device)
        if rank == 0:
            logger.info("epoch %d loss %.4f train_acc %.4f val %.4f +- %.4f (%.0fs)",
                        epoch, loss, train_acc, val_acc, val_ci, time.time() - t0)
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "val_acc": val_acc}, best_path)
        dist.barrier()

    ckpt = torch.load(best_path, map_location=device)
    model.module.load_state_dict(ckpt["model"])
    test_loader = episodic_loader(image_dir, test_cls, False, args.test_episodes // world_size, args,
                                  seed=args.seed * 1000 + 200 + rank)
    test_acc, test_ci = evaluate(model, test_loader, args, device)
    if rank == 0:
        logger.info("best epoch %d: test %d-way %d-shot acc %.2f +- %.2f",
                    ckpt["epoch"], args.n_way, args.n_shot, 100 * test_acc, 100 * test_ci)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
