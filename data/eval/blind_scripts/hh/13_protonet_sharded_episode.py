#!/usr/bin/env python3
"""High-way ProtoNet training with one large episode sharded across GPUs.

Very wide episodes (e.g. 60-way 5-shot, 15 queries => 1200 images at 84x84 through a
ResNet-12) do not fit one GPU. Every rank draws the SAME episode (same sampler seed on
all ranks), embeds only its slice of the support and query images, and the support
embeddings are all-gathered with the autograd-aware all_gather so prototypes are built
from the whole support set and gradients flow back to the rank that produced them.
BatchNorm is synchronised so that the episode is normalised as one batch.

    torchrun --nproc_per_node=4 13_protonet_sharded_episode.py --root /data/mini-imagenet --way 60
"""
import argparse
import csv
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset
from torchvision import transforms


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/mini-imagenet")
    ap.add_argument("--out", default="runs/proto_wide")
    ap.add_argument("--way", type=int, default=60)
    ap.add_argument("--shot", type=int, default=5)
    ap.add_argument("--query", type=int, default=16)
    ap.add_argument("--test-way", type=int, default=5)
    ap.add_argument("--test-query", type=int, default=15)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--episodes", type=int, default=200, help="episodes per epoch (each one spans all GPUs)")
    ap.add_argument("--val-episodes", type=int, default=600)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    return ap.parse_args()


class Mini(Dataset):
    def __init__(self, root, split, train):
        rows = list(csv.DictReader(open(os.path.join(root, f"{split}.csv"))))
        wnids = sorted({r["label"] for r in rows})
        idx = {w: i for i, w in enumerate(wnids)}
        self.paths = [os.path.join(root, "images", r["filename"]) for r in rows]
        self.labels = np.array([idx[r["label"]] for r in rows])
        norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        aug = [transforms.RandomResizedCrop(84, scale=(0.2, 1.0)), transforms.RandomHorizontalFlip()] if train \
            else [transforms.Resize(92), transforms.CenterCrop(84)]
        self.tf = transforms.Compose(aug + [transforms.ToTensor(), norm])

    def load(self, indices, pool):
        return torch.stack(list(pool.map(lambda i: self.tf(Image.open(self.paths[i]).convert("RGB")), indices)))


def draw_episode(labels, way, per_class, rng):
    classes = rng.choice(labels.max() + 1, way, replace=False)
    return np.stack([rng.choice(np.flatnonzero(labels == c), per_class, replace=False) for c in classes])


class Block(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.LeakyReLU(0.1),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.LeakyReLU(0.1),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout))
        self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.tail = nn.Sequential(nn.LeakyReLU(0.1), nn.MaxPool2d(2))

    def forward(self, x):
        return self.tail(self.conv(x) + self.short(x))


class ResNet12(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(3, 64), Block(64, 160), Block(160, 320), Block(320, 640))

    def forward(self, x):
        return self.blocks(x).mean((2, 3))


def shard(t, rank, world):
    assert t.size(0) % world == 0, f"{t.size(0)} items do not split over {world} ranks"
    n = t.size(0) // world
    return t[rank * n:(rank + 1) * n]


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(args.workers)

    train_set, val_set = Mini(args.root, "train", True), Mini(args.root, "val", False)
    # same seed on every rank on purpose: all ranks must work on the same episode
    episode_rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(ResNet12()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * args.episodes)

    n_sup = args.way * args.shot
    best = 0.0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        log = torch.zeros(3, device=device)
        for _ in range(args.episodes):
            ep = draw_episode(train_set.labels, args.way, args.shot + args.query, episode_rng)
            # shot-major flattening, so global support index i has class i % way
            sup_idx = ep[:, :args.shot].T.reshape(-1)
            qry_idx = ep[:, args.shot:].T.reshape(-1)
            qry_lab = torch.arange(args.way).repeat(args.query)
            my_sup, my_qry = shard(torch.from_numpy(sup_idx), rank, world), shard(torch.from_numpy(qry_idx), rank, world)
            my_lab = shard(qry_lab, rank, world).to(device)

            x = train_set.load(torch.cat([my_sup, my_qry]).tolist(), pool).to(device, non_blocking=True)
            z = model(x)
            z_sup, z_qry = z[: my_sup.numel()], z[my_sup.numel():]
            all_sup = torch.cat(dist_fn.all_gather(z_sup), dim=0)  # [n_sup, d], rank order = global order
            assert all_sup.size(0) == n_sup
            protos = all_sup.view(args.shot, args.way, -1).mean(0)
            logits = -torch.cdist(z_qry, protos).pow(2) / protos.size(-1)
            loss = F.cross_entropy(logits, my_lab)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            log += torch.stack([loss.detach(), (logits.argmax(1) == my_lab).float().mean(), torch.ones_like(loss)])
        dist.all_reduce(log)

        # validation: ordinary 5-way episodes, a different one on every rank, no collectives inside
        model.eval()
        vrng = np.random.default_rng(100_000 + rank)
        vacc = torch.zeros(2, device=device)
        with torch.no_grad():
            for _ in range(args.val_episodes // world):
                ep = draw_episode(val_set.labels, args.test_way, args.shot + args.test_query, vrng)
                x = val_set.load(ep.T.reshape(-1).tolist(), pool).to(device)
                z = model.module(x)
                protos = z[: args.test_way * args.shot].view(args.shot, args.test_way, -1).mean(0)
                pred = torch.cdist(z[args.test_way * args.shot:], protos).argmin(1).cpu()
                y = torch.arange(args.test_way).repeat(args.test_query)
                vacc += torch.tensor([(pred == y).float().mean().item(), 1.0], device=device)
        dist.all_reduce(vacc)
        val_acc = (vacc[0] / vacc[1]).item()

        if rank == 0:
            print(f"epoch {epoch} loss {(log[0] / log[2]).item():.3f} acc {(log[1] / log[2]).item():.3f} "
                  f"val {val_acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict()}, os.path.join(args.out, "last.pt"))
            if val_acc > best:
                best = val_acc
                torch.save({"epoch": epoch, "model": model.module.state_dict()}, os.path.join(args.out, "best.pt"))

    pool.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
