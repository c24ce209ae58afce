#!/usr/bin/env python3
"""Episodic fine-tuning of a pre-trained ResNet-12 with the prototypical loss.

Stage 2 of the usual two-stage recipe: stage 1 (pretrain_classifier.py) trains
FewShotNet with a 64-way linear classifier; here we start from that checkpoint
and fine-tune with 5-way episodes, one episode per GPU per step.

    torchrun --nproc_per_node=4 06_protonet_finetune_pretrained.py \
        --config configs/proto_r12_mini.yaml --pretrained runs/pretrain/best.pth
"""
import argparse
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

logger = logging.getLogger("proto_ft")

DEFAULTS = dict(
    root="/data/miniImageNet",
    out_dir="runs/proto_ft",
    num_pretrain_classes=64,
    way=5, shot=1, query=15,
    epochs=100, episodes_per_epoch=1000, val_episodes=1000,
    lr=1e-4, weight_decay=5e-4, milestones=[40, 80],
    workers=8, seed=0,
)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--pretrained", required=True)
    ap.add_argument("--shot", type=int, default=None)
    args = ap.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    if args.shot is not None:
        cfg["shot"] = args.shot
    cfg["pretrained"] = args.pretrained
    return argparse.Namespace(**cfg)


class ImageFolderSplit(Dataset):
    def __init__(self, root, split, train):
        split_dir = os.path.join(root, split)
        self.classes = sorted(os.listdir(split_dir))
        self.items = []
        for c, wnid in enumerate(self.classes):
            for f in sorted(os.listdir(os.path.join(split_dir, wnid))):
                self.items.append((os.path.join(split_dir, wnid, f), c))
        self.labels = np.array([c for _, c in self.items])
        norm = transforms.Normalize([0.472, 0.453, 0.410], [0.277, 0.268, 0.285])
        if train:
            self.tf = transforms.Compose([transforms.RandomResizedCrop(84), transforms.RandomHorizontalFlip(),
                                          transforms.ToTensor(), norm])
        else:
            self.tf = transforms.Compose([transforms.Resize(92), transforms.CenterCrop(84),
                                          transforms.ToTensor(), norm])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, c = self.items[i]
        return self.tf(Image.open(path).convert("RGB")), c


class EpisodeSampler:
    def __init__(self, labels, n_episodes, way, per_class, seed):
        self.pools = [np.flatnonzero(labels == c) for c in range(labels.max() + 1)]
        self.n_episodes, self.way, self.per_class = n_episodes, way, per_class
        self.rng = random.Random(seed)

    def __len__(self):
        return self.n_episodes

    def __iter__(self):
        for _ in range(self.n_episodes):
            classes = self.rng.sample(range(len(self.pools)), self.way)
            picks = [self.rng.sample(list(self.pools[c]), self.per_class) for c in classes]
            # shot-major layout: [s0c0, s0c1, ..., s0cW, s1c0, ...]
            yield [picks[c][k] for k in range(self.per_class) for c in range(self.way)]


def conv3x3(cin, cout):
    return nn.Conv2d(cin, cout, 3, padding=1, bias=False)


class ResBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.body = nn.Sequential(conv3x3(cin, cout), nn.BatchNorm2d(cout), nn.LeakyReLU(0.1),
                                  conv3x3(cout, cout), nn.BatchNorm2d(cout), nn.LeakyReLU(0.1),
                                  conv3x3(cout, cout), nn.BatchNorm2d(cout))
        self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.out = nn.Sequential(nn.LeakyReLU(0.1), nn.MaxPool2d(2))

    def forward(self, x):
        return self.out(self.body(x) + self.skip(x))


class FewShotNet(nn.Module):
    """ResNet-12 trunk + linear classifier over the base classes (used in pre-training)."""

    def __init__(self, num_classes, widths=(64, 160, 320, 640)):
        super().__init__()
        blocks, cin = [], 3
        for w in widths:
            blocks.append(ResBlock(cin, w))
            cin = w
        self.trunk = nn.Sequential(*blocks)
        self.feat_dim = cin
        self.classifier = nn.Linear(cin, num_classes)

    def forward(self, x):
        feat = self.trunk(x).mean(dim=(2, 3))
        return feat, self.classifier(feat)


def proto_loss(feat, way, shot, query_labels):
    support, query = feat[: way * shot], feat[way * shot:]
    protos = support.view(shot, way, -1).mean(0)
    logits = -torch.cdist(query, protos).pow(2) / 64.0
    return F.cross_entropy(logits, query_labels), (logits.argmax(1) == query_labels).float().mean()


def run_epoch(model, loader, cfg, device, optimizer=None):
    training = optimizer is not None
    model.train(training)
    q_labels = torch.arange(cfg.way, device=device).repeat(cfg.query)
    meter = torch.zeros(3, device=device)
    with torch.set_grad_enabled(training):
        for images, _ in loader:
            images = images.to(device, non_blocking=True)
            feat, _ = model(images)
            loss, acc = proto_loss(feat, cfg.way, cfg.shot, q_labels)
            if training:
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            meter += torch.stack([loss.detach(), acc, torch.ones_like(acc)])
    dist.all_reduce(meter)
    return (meter[0] / meter[2]).item(), (meter[1] / meter[2]).item()


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    torch.manual_seed(cfg.seed)

    train_ds = ImageFolderSplit(cfg.root, "train", train=True)
    val_ds = ImageFolderSplit(cfg.root, "val", train=False)
    train_loader = DataLoader(
        train_ds, num_workers=cfg.workers, pin_memory=True,
        batch_sampler=EpisodeSampler(train_ds.labels, cfg.episodes_per_epoch // world, cfg.way,
                                     cfg.shot + cfg.query, seed=cfg.seed * 100 + rank))
    val_loader = DataLoader(
        val_ds, num_workers=cfg.workers, pin_memory=True,
        batch_sampler=EpisodeSampler(val_ds.labels, cfg.val_episodes // world, cfg.way,
                                     cfg.shot + cfg.query, seed=10 ** 6 + rank))

    model = FewShotNet(cfg.num_pretrain_classes)
    state = torch.load(cfg.pretrained, map_location="cpu")
    state = state.get("model", state)
    model.load_state_dict({k.replace("module.", "", 1): v for k, v in state.items()})
    model = DDP(model.to(device), device_ids=[local_rank])

    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, nesterov=True,
                                weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=cfg.milestones, gamma=0.1)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(vars(cfg), f)

    best_acc = 0.0
    for epoch in range(1, cfg.epochs + 1):
        t = time.time()
        tr_loss, tr_acc = run_epoch(model, train_loader, cfg, device, optimizer)
        scheduler.step()
        va_loss, va_acc = run_epoch(model, val_loader, cfg, device)
        if rank == 0:
            logger.info("[%d/%d] train %.3f/%.3f val %.3f/%.3f lr %.2e %.0fs", epoch, cfg.epochs, tr_loss,
                        tr_acc, va_loss, va_acc, scheduler.get_last_lr()[0], time.time() - t)
            ckpt = {"epoch": epoch, "model": model.module.state_dict(), "val_acc": va_acc}
            torch.save(ckpt, os.path.join(cfg.out_dir, "last.pth"))
            if va_acc > best_acc:
                best_acc = va_acc
                torch.save(ckpt, os.path.join(cfg.out_dir, "best.pth"))
        dist.barrier()

    if rank == 0:
        logger.info("done, best val acc %.4f", best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
