#!/usr/bin/env python3
"""ProtoNet with a ResNet-12 backbone and learnable metric scale on miniImageNet.

Data layout (Ravi & Larochelle split):
    <root>/images/*.jpg  <root>/train.csv  <root>/val.csv  <root>/test.csv

Launch:
    torchrun --nproc_per_node=8 02_protonet_resnet12_mini.py --root /data/mini-imagenet
"""
import argparse
import csv
import logging
import math
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
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms

log = logging.getLogger(__name__)

MEAN = [120.39586422 / 255.0, 115.59361427 / 255.0, 104.54012653 / 255.0]
STD = [70.68188272 / 255.0, 68.27635443 / 255.0, 72.54505529 / 255.0]


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=str, required=True)
    parser.add_argument("--save-dir", type=str, default="checkpoints/proto_r12")
    parser.add_argument("--way", type=int, default=5)
    parser.add_argument("--shot", type=int, default=1)
    parser.add_argument("--query", type=int, default=15)
    parser.add_argument("--max-epoch", type=int, default=120)
    parser.add_argument("--episodes", type=int, default=800, help="training episodes per epoch, all GPUs")
    parser.add_argument("--val-episodes", type=int, default=1600)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--wd", type=float, default=5e-4)
    parser.add_argument("--init-scale", type=float, default=10.0)
    parser.add_argument("--drop-rate", type=float, default=0.1)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


class MiniImageNet(Dataset):
    def __init__(self, root, split, train_aug=False):
        self.img_dir = os.path.join(root, "images")
        self.files, self.labels, wnids = [], [], {}
        with open(os.path.join(root, f"{split}.csv")) as f:
            for row in csv.DictReader(f):
                wnids.setdefault(row["label"], len(wnids))
                self.files.append(row["filename"])
                self.labels.append(wnids[row["label"]])
        self.num_classes = len(wnids)
        if train_aug:
            self.tf = transforms.Compose([
                transforms.RandomCrop(84, padding=8),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                transforms.Normalize(MEAN, STD),
            ])
        else:
            self.tf = transforms.Compose([
                transforms.Resize(84),
                transforms.CenterCrop(84),
                transforms.ToTensor(),
                transforms.Normalize(MEAN, STD),
            ])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        img = Image.open(os.path.join(self.img_dir, self.files[idx])).convert("RGB")
        return self.tf(img), self.labels[idx]


class CategoriesSampler:
    def __init__(self, labels, n_batch, n_cls, n_per, seed):
        labels = np.array(labels)
        self.n_batch, self.n_cls, self.n_per = n_batch, n_cls, n_per
        self.m_ind = [torch.from_numpy(np.argwhere(labels == i).reshape(-1)) for i in range(labels.max() + 1)]
        self.gen = torch.Generator().manual_seed(seed)

    def __len__(self):
        return self.n_batch

    def __iter__(self):
        for _ in range(self.n_batch):
            classes = torch.randperm(len(self.m_ind), generator=self.gen)[: self.n_cls]
            batch = []
            for c in classes:
                idx = self.m_ind[c]
                batch.append(idx[torch.randperm(len(idx), generator=self.gen)[: self.n_per]])
            yield torch.stack(batch).t().reshape(-1).tolist()


class BasicBlock(nn.Module):
    def __init__(self, inplanes, planes, drop_rate=0.0):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes)
        self.relu = nn.LeakyReLU(0.1)
        self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, bias=False), nn.BatchNorm2d(planes))
        self.pool = nn.MaxPool2d(2)
        self.drop_rate = drop_rate

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out = self.pool(self.relu(out + self.downsample(x)))
        if self.drop_rate > 0:
            out = F.dropout(out, p=self.drop_rate, training=self.training)
        return out


class ResNet12(nn.Module):
    def __init__(self, channels=(64, 160, 320, 640), drop_rate=0.1):
        super().__init__()
        layers, inplanes = [], 3
        for planes in channels:
            layers.append(BasicBlock(inplanes, planes, drop_rate))
            inplanes = planes
        self.layers = nn.Sequential(*layers)
        self.out_dim = channels[-1]
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="leaky_relu")

    def forward(self, x):
        return self.layers(x).mean(dim=(2, 3))


class ProtoNet(nn.Module):
    def __init__(self, drop_rate, init_scale):
        super().__init__()
        self.encoder = ResNet12(drop_rate=drop_rate)
        self.scale = nn.Parameter(torch.tensor(float(init_scale)))

    def forward(self, x, way, shot):
        feats = self.encoder(x)
        support, query = feats[: way * shot], feats[way * shot:]
        protos = support.view(shot, way, -1).mean(0)
        return -self.scale * torch.cdist(query, protos).pow(2) / feats.size(1)


def episode_stats(logits, labels):
    return (logits.argmax(dim=1) == labels).float().mean()


@torch.no_grad()
def evaluate(model, loader, way, shot, query, device):
    model.eval()
    labels = torch.arange(way, device=device).repeat(query)
    acc_sum = torch.zeros(2, device=device, dtype=torch.float64)
    acc_sq = torch.zeros(1, device=device, dtype=torch.float64)
    for data, _ in loader:
        feats = model.encoder(data.to(device, non_blocking=True))
        support, q = feats[: way * shot], feats[way * shot:]
        protos = support.view(shot, way, -1).mean(0)
        acc = episode_stats(-torch.cdist(q, protos), labels).double()
        acc_sum += torch.stack([acc, torch.ones_like(acc)])
        acc_sq += acc * acc
    dist.all_reduce(acc_sum)
    dist.all_reduce(acc_sq)
    n = acc_sum[1]
    mean = acc_sum[0] / n
    std = torch.sqrt(torch.clamp(acc_sq[0] / n - mean ** 2, min=0.0))
    return mean.item(), (1.96 * std / torch.sqrt(n)).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True

    train_set = MiniImageNet(args.root, "train", train_aug=True)
    val_set = MiniImageNet(args.root, "val")
    train_sampler = CategoriesSampler(train_set.labels, args.episodes // world, args.way,
                                      args.shot + args.query, seed=args.seed + 1000 * rank)
    val_sampler = CategoriesSampler(val_set.labels, args.val_episodes // world, args.way,
                                    args.shot + args.query, seed=12345 + rank)
    train_loader = DataLoader(train_set, batch_sampler=train_sampler, num_workers=args.num_workers, pin_memory=True)
    val_loader = DataLoader(val_set, batch_sampler=val_sampler, num_workers=args.num_workers, pin_memory=True)

    model = ProtoNet(args.drop_rate, args.init_scale).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                nesterov=True, weight_decay=args.wd)
    steps_per_epoch = len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / (args.max_epoch * steps_per_epoch))))

    writer = None
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.save_dir, "tb"))
    labels = torch.arange(args.way, device=device).repeat(args.query)
    best = 0.0
    global_step = 0

    for epoch in range(1, args.max_epoch + 1):
        model.train()
        tic = time.time()
        running = torch.zeros(2, device=device)
        for data, _ in train_loader:
            data = data.to(device, non_blocking=True)
            logits = model(data, args.way, args.shot)
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            global_step += 1
            running += torch.stack([loss.detach(), episode_stats(logits.detach(), labels)])
        running /= steps_per_epoch
        dist.all_reduce(running)
        running /= world

        va, ci = evaluate(model, val_loader, args.way, args.shot, args.query, device)
        if rank == 0:
            log.info("ep %03d loss %.3f acc %.3f | val %.4f+-%.4f | %.1fs", epoch, running[0].item(),
                     running[1].item(), va, ci, time.time() - tic)
            writer.add_scalar("train/loss", running[0].item(), epoch)
            writer.add_scalar("val/acc", va, epoch)
            state = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "val_acc": va}
            torch.save(state, os.path.join(args.save_dir, "last.pth"))
            if va > best:
                best = va
                torch.save(state, os.path.join(args.save_dir, "max_acc.pth"))

    if rank == 0:
        writer.close()
        log.info("best val acc %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
