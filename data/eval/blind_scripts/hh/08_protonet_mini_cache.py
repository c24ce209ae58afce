#!/usr/bin/env python3
"""Prototypical networks on miniImageNet from the full-resolution ImageNet crops.

Decoding and resizing the JPEGs every episode makes the loader the bottleneck, so
each split is decoded once, resized to 84x84 and cached as a uint8 pickle next to
the data (~800 MB for train). Later runs load the cache directly.

    torchrun --nproc_per_node=8 08_protonet_mini_cache.py --root /data/mini-imagenet-raw \
        --cache-dir /data/mini-imagenet-raw/cache --exp runs/mini_proto_5s
"""
import argparse
import logging
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

logger = logging.getLogger("mini_cache")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/mini-imagenet-raw")
    ap.add_argument("--cache-dir", default="/data/mini-imagenet-raw/cache")
    ap.add_argument("--exp", default="runs/mini_proto")
    ap.add_argument("--way", type=int, default=5)
    ap.add_argument("--train-way", type=int, default=20)
    ap.add_argument("--shot", type=int, default=5)
    ap.add_argument("--query", type=int, default=15)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--episodes", type=int, default=1600, help="per epoch, all GPUs together")
    ap.add_argument("--val-episodes", type=int, default=800)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=3)
    return ap.parse_args()


def load_split(root, split, cache_dir, size=84):
    """Returns (images uint8 [N, size, size, 3], labels int64 [N])."""
    cache = os.path.join(cache_dir, f"mini_{split}_{size}.pkl")
    if os.path.exists(cache):
        with open(cache, "rb") as f:
            blob = pickle.load(f)
        return blob["images"], blob["labels"]

    split_dir = os.path.join(root, split)
    wnids = sorted(os.listdir(split_dir))
    images, labels = [], []
    for label, wnid in enumerate(wnids):
        for fname in sorted(os.listdir(os.path.join(split_dir, wnid))):
            im = Image.open(os.path.join(split_dir, wnid, fname)).convert("RGB")
            images.append(np.asarray(im.resize((size, size), Image.BILINEAR), dtype=np.uint8))
            labels.append(label)
    images = np.stack(images)
    labels = np.asarray(labels, dtype=np.int64)
    os.makedirs(cache_dir, exist_ok=True)
    with open(cache, "wb") as f:
        pickle.dump({"images": images, "labels": labels, "wnids": wnids}, f, protocol=4)
    return images, labels


class ArrayDataset(Dataset):
    MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
    STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)

    def __init__(self, images, labels, flip=False):
        self.images, self.labels, self.flip = images, labels, flip

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        img = self.images[i].astype(np.float32) / 255.0
        if self.flip and np.random.rand() < 0.5:
            img = img[:, ::-1]
        img = (img - self.MEAN) / self.STD
        return torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))), int(self.labels[i])


class EpisodeBatchSampler:
    def __init__(self, labels, n_episodes, way, n_per, seed):
        self.idx_by_class = [np.flatnonzero(labels == c) for c in range(int(labels.max()) + 1)]
        self.n_episodes, self.way, self.n_per = n_episodes, way, n_per
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return self.n_episodes

    def __iter__(self):
        for _ in range(self.n_episodes):
            cls = self.rng.permutation(len(self.idx_by_class))[: self.way]
            sel = np.stack([self.rng.choice(self.idx_by_class[c], self.n_per, replace=False) for c in cls], 1)
            yield sel.reshape(-1).tolist()


class ConvEncoder(nn.Module):
    def __init__(self, hid=64):
        super().__init__()

        def blk(i, o):
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(), nn.MaxPool2d(2))

        self.net = nn.Sequential(blk(3, hid), blk(hid, hid), blk(hid, hid), blk(hid, hid))

    def forward(self, x):
        return self.net(x).flatten(1)


def episode_loss(model, x, way, shot, query, device):
    z = model(x)
    n_s = way * shot
    protos = z[:n_s].view(shot, way, -1).mean(0)
    logits = -torch.cdist(z[n_s:], protos) ** 2
    y = torch.arange(way, device=device).repeat(query)
    return F.cross_entropy(logits, y), (logits.argmax(-1) == y).float().mean()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(message)s")

    t0 = time.time()
    tr_x, tr_y = load_split(args.root, "train", args.cache_dir)
    va_x, va_y = load_split(args.root, "val", args.cache_dir)
    logger.info("loaded %d train / %d val images in %.0fs", len(tr_y), len(va_y), time.time() - t0)

    train_dl = DataLoader(ArrayDataset(tr_x, tr_y, flip=True), num_workers=args.workers, pin_memory=True,
                          batch_sampler=EpisodeBatchSampler(tr_y, args.episodes // world, args.train_way,
                                                            args.shot + args.query, seed=args.seed * 997 + rank))
    val_dl = DataLoader(ArrayDataset(va_x, va_y), num_workers=args.workers, pin_memory=True,
                        batch_sampler=EpisodeBatchSampler(va_y, args.val_episodes // world, args.way,
                                                          args.shot + args.query, seed=2024 + rank))

    torch.manual_seed(args.seed)
    model = DDP(ConvEncoder().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=25, gamma=0.5)
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        m = torch.zeros(3, device=device)
        for x, _ in train_dl:
            loss, acc = episode_loss(model, x.to(device, non_blocking=True), args.train_way, args.shot,
                                     args.query, device)
            opt.zero_grad()
            loss.backward()
            opt.step()
            m += torch.stack([loss.detach(), acc, torch.ones_like(acc)])
        sched.step()

        model.eval()
        v = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, _ in val_dl:
                _, acc = episode_loss(model, x.to(device, non_blocking=True), args.way, args.shot,
                                      args.query, device)
                v += torch.stack([acc, torch.ones_like(acc)])
        dist.all_reduce(m)
        dist.all_reduce(v)
        val_acc = (v[0] / v[1]).item()
        if rank == 0:
            logger.info("epoch %d loss %.4f train acc %.4f val acc %.4f", epoch, (m[0] / m[2]).item(),
                        (m[1] / m[2]).item(), val_acc)
            torch.save({"epoch": epoch, "state_dict": model.module.state_dict()},
                       os.path.join(args.exp, "last.pth"))
            if val_acc > best:
                best = val_acc
                torch.save({"epoch": epoch, "state_dict": model.module.state_dict()},
                           os.path.join(args.exp, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
