#!/usr/bin/env python3
"""Relation Network (Sung et al. 2018) on CUB-200 (cropped), 5-way, DDP over episodes.

Uses the standard closer-look-at-few-shot json splits (base.json / val.json / novel.json,
each {"image_names": [...], "image_labels": [...]}).

    torchrun --nproc_per_node=4 16_relationnet_cub.py --split-dir filelists/CUB --shot 5 --ckpt-dir ckpt/relnet_cub_5s
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
import torchvision.transforms as T

logger = logging.getLogger("relnet")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--split-dir", default="filelists/CUB")
    ap.add_argument("--ckpt-dir", default="ckpt/relnet_cub")
    ap.add_argument("--n-way", type=int, default=5)
    ap.add_argument("--shot", type=int, default=5)
    ap.add_argument("--n-query", type=int, default=16)
    ap.add_argument("--stop-epoch", type=int, default=400)
    ap.add_argument("--episodes", type=int, default=100, help="episodes per GPU per epoch")
    ap.add_argument("--val-episodes", type=int, default=600, help="across all GPUs")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--save-freq", type=int, default=50)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class SimpleSetDataset(Dataset):
    def __init__(self, split_file, train):
        with open(split_file) as f:
            meta = json.load(f)
        self.paths = meta["image_names"]
        raw = meta["image_labels"]
        self.classes = sorted(set(raw))
        remap = {c: i for i, c in enumerate(self.classes)}
        self.labels = np.array([remap[c] for c in raw])
        norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        if train:
            self.tf = T.Compose([T.RandomResizedCrop(84), T.ColorJitter(0.4, 0.4, 0.4), T.RandomHorizontalFlip(),
                                 T.ToTensor(), norm])
        else:
            self.tf = T.Compose([T.Resize(96), T.CenterCrop(84), T.ToTensor(), norm])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.tf(Image.open(self.paths[i]).convert("RGB")), self.labels[i]


class EpisodicBatchSampler:
    def __init__(self, labels, n_episodes, n_way, n_per, seed):
        self.cls_idx = [np.flatnonzero(labels == c) for c in range(labels.max() + 1)]
        self.n_episodes, self.n_way, self.n_per = n_episodes, n_way, n_per
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return self.n_episodes

    def __iter__(self):
        for _ in range(self.n_episodes):
            cls = self.rng.choice(len(self.cls_idx), self.n_way, replace=False)
            yield np.concatenate([self.rng.choice(self.cls_idx[c], self.n_per, replace=False) for c in cls]).tolist()


def conv_block(i, o, pool=True, padding=0):
    layers = [nn.Conv2d(i, o, 3, padding=padding), nn.BatchNorm2d(o, momentum=1.0, affine=True), nn.ReLU()]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class RelationNet(nn.Module):
    def __init__(self, n_way, shot):
        super().__init__()
        self.n_way, self.shot = n_way, shot
        # feature extractor keeps spatial maps: 84 -> 19x19x64
        self.feature = nn.Sequential(conv_block(3, 64), conv_block(64, 64), conv_block(64, 64, False, 1),
                                     conv_block(64, 64, False, 1))
        self.relation = nn.Sequential(conv_block(128, 64, True, 1), conv_block(64, 64, True, 1),
                                      nn.Flatten(), nn.Linear(64 * 4 * 4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x, n_query):
        f = self.feature(x)
        c, h, w = f.shape[1:]
        f = f.view(self.n_way, self.shot + n_query, c, h, w)
        support = f[:, : self.shot].sum(1)                          # [way, c, h, w]
        query = f[:, self.shot:].reshape(-1, c, h, w)               # [way*q, c, h, w]
        nq = query.size(0)
        pairs = torch.cat([support.unsqueeze(0).expand(nq, -1, -1, -1, -1),
                           query.unsqueeze(1).expand(-1, self.n_way, -1, -1, -1)], dim=2)
        scores = self.relation(pairs.reshape(-1, 2 * c, h, w)).view(nq, self.n_way)
        return torch.sigmoid(scores)


def save_checkpoint(path, epoch, model, optimizer, best_acc):
    torch.save({"epoch": epoch, "state": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "best_acc": best_acc}, path)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    os.makedirs(args.ckpt_dir, exist_ok=True)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    base = SimpleSetDataset(os.path.join(args.split_dir, "base.json"), train=True)
    val = SimpleSetDataset(os.path.join(args.split_dir, "val.json"), train=False)
    n_per = args.shot + args.n_query
    base_loader = DataLoader(base, batch_sampler=EpisodicBatchSampler(base.labels, args.episodes, args.n_way, n_per,
                                                                      seed=args.seed * 1000 + rank),
                             num_workers=8, pin_memory=True)
    val_loader = DataLoader(val, batch_sampler=EpisodicBatchSampler(val.labels, args.val_episodes // world,
                                                                    args.n_way, n_per, seed=4242 + rank),
                            num_workers=8, pin_memory=True)

    model = DDP(RelationNet(args.n_way, args.shot).to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    start_epoch, best_acc = 0, 0.0
    last_path = os.path.join(args.ckpt_dir, "last.tar")
    if args.resume and os.path.isfile(last_path):
        ckpt = torch.load(last_path, map_location=device)
        model.module.load_state_dict(ckpt["state"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]
        logger.info("resuming at epoch %d", start_epoch)

    # MSE against one-hot targets, as in the paper
    target = F.one_hot(torch.arange(args.n_way, device=device).repeat_interleave(args.n_query), args.n_way).float()
    for epoch in range(start_epoch, args.stop_epoch):
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for x, _ in base_loader:
            scores = model(x.to(device, non_blocking=True), args.n_query)
            loss = F.mse_loss(scores, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run += torch.stack([loss.detach(), torch.ones_like(loss)])

        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, _ in val_loader:
                scores = model(x.to(device, non_blocking=True), args.n_query)
                acc += torch.stack([(scores.argmax(1) == target.argmax(1)).float().mean(),
                                    torch.ones((), device=device)])
        dist.all_reduce(run)
        dist.all_reduce(acc)
        val_acc = (acc[0] / acc[1]).item()
        logger.info("epoch %d | loss %.5f | val acc %.2f%% | %.0fs", epoch, (run[0] / run[1]).item(),
                    100 * val_acc, time.time() - t0)

        if val_acc > best_acc:
            best_acc = val_acc
            save_checkpoint(os.path.join(args.ckpt_dir, "best_model.tar"), epoch, model, optimizer, best_acc)
        if epoch % args.save_freq == 0 or epoch == args.stop_epoch - 1:
            save_checkpoint(os.path.join(args.ckpt_dir, f"{epoch}.tar"), epoch, model, optimizer, best_acc)
        save_checkpoint(last_path, epoch, model, optimizer, best_acc)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
