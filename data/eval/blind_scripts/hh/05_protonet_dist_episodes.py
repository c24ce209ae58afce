#!/usr/bin/env python3
"""Prototypical networks (Snell et al.) on miniImageNet with a distributed episodic sampler.

The sampler draws a different stream of episodes on every rank and reshuffles the
stream each epoch (seeded by seed, epoch and rank, so runs are reproducible).

    torchrun --nproc_per_node=4 05_protonet_dist_episodes.py --data-dir /datasets/miniImageNet \
        --shot 1 --save-path ./save/proto-1shot
"""
import argparse
import os
import os.path as osp
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


class MiniImageNet(Dataset):
    def __init__(self, data_dir, setname):
        lines = [x.strip() for x in open(osp.join(data_dir, "split", setname + ".csv"), "r").readlines()][1:]
        data, label = [], []
        lb = -1
        self.wnids = []
        for line in lines:
            name, wnid = line.split(",")
            if wnid not in self.wnids:
                self.wnids.append(wnid)
                lb += 1
            data.append(osp.join(data_dir, "images", name))
            label.append(lb)
        self.data, self.label = data, label
        self.transform = transforms.Compose([
            transforms.Resize(84),
            transforms.CenterCrop(84),
            transforms.ToTensor(),
            transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
        ])

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.transform(Image.open(self.data[i]).convert("RGB")), self.label[i]


class DistributedCategoriesSampler(Sampler):
    """Episode sampler for DDP: n_batch episodes per rank, different on every rank and every epoch."""

    def __init__(self, label, n_batch, n_cls, n_per, rank, seed=0):
        self.n_batch, self.n_cls, self.n_per = n_batch, n_cls, n_per
        self.rank, self.seed, self.epoch = rank, seed, 0
        label = np.array(label)
        self.m_ind = [torch.from_numpy(np.argwhere(label == i).reshape(-1)) for i in range(max(label) + 1)]

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.n_batch

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + 7919 * self.epoch + 104729 * self.rank)
        for _ in range(self.n_batch):
            classes = torch.randperm(len(self.m_ind), generator=g)[: self.n_cls]
            batch = []
            for c in classes:
                l = self.m_ind[c]
                batch.append(l[torch.randperm(len(l), generator=g)[: self.n_per]])
            yield torch.stack(batch).t().reshape(-1)


def conv_block(in_channels, out_channels):
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(),
        nn.MaxPool2d(2),
    )


class Convnet(nn.Module):
    def __init__(self, x_dim=3, hid_dim=64, z_dim=64):
        super().__init__()
        self.encoder = nn.Sequential(
            conv_block(x_dim, hid_dim),
            conv_block(hid_dim, hid_dim),
            conv_block(hid_dim, hid_dim),
            conv_block(hid_dim, z_dim),
        )
        self.out_channels = 1600

    def forward(self, x):
        x = self.encoder(x)
        return x.view(x.size(0), -1)


def euclidean_metric(a, b):
    n, m = a.shape[0], b.shape[0]
    a = a.unsqueeze(1).expand(n, m, -1)
    b = b.unsqueeze(0).expand(n, m, -1)
    return -((a - b) ** 2).sum(dim=2)


class Averager:
    def __init__(self, device):
        self.buf = torch.zeros(2, device=device)

    def add(self, x):
        self.buf[0] += x
        self.buf[1] += 1

    def item(self):
        dist.all_reduce(self.buf)
        return (self.buf[0] / self.buf[1]).item()


def count_acc(logits, label):
    return (torch.argmax(logits, dim=1) == label).float().mean()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-epoch", type=int, default=200)
    parser.add_argument("--save-epoch", type=int, default=20)
    parser.add_argument("--shot", type=int, default=1)
    parser.add_argument("--query", type=int, default=15)
    parser.add_argument("--train-way", type=int, default=30)
    parser.add_argument("--test-way", type=int, default=5)
    parser.add_argument("--episodes", type=int, default=100, help="training episodes per rank per epoch")
    parser.add_argument("--val-episodes", type=int, default=400, help="validation episodes over all ranks")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default="/datasets/miniImageNet")
    parser.add_argument("--save-path", default="./save/proto-1")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.save_path, exist_ok=True)
        print(vars(args))

    trainset = MiniImageNet(args.data_dir, "train")
    train_sampler = DistributedCategoriesSampler(trainset.label, args.episodes, args.train_way,
                                                 args.shot + args.query, rank=rank, seed=args.seed)
    train_loader = DataLoader(trainset, batch_sampler=train_sampler, num_workers=8, pin_memory=True)

    valset = MiniImageNet(args.data_dir, "val")
    val_sampler = DistributedCategoriesSampler(valset.label, args.val_episodes // world_size, args.test_way,
                                               args.shot + args.query, rank=rank, seed=args.seed + 1)
    val_loader = DataLoader(valset, batch_sampler=val_sampler, num_workers=8, pin_memory=True)

    torch.manual_seed(args.seed)
    model = DDP(Convnet().to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)

    def save_model(name):
        torch.save(model.module.state_dict(), osp.join(args.save_path, name + ".pth"))

    trlog = {"args": vars(args), "train_loss": [], "val_loss": [], "train_acc": [], "val_acc": [], "max_acc": 0.0}
    p = args.shot * args.train_way
    label = torch.arange(args.train_way, device=device).repeat(args.query)
    val_label = torch.arange(args.test_way, device=device).repeat(args.query)
    t0 = time.time()

    for epoch in range(1, args.max_epoch + 1):
        model.train()
        tl, ta = Averager(device), Averager(device)
        for i, batch in enumerate(train_loader, 1):
            data = batch[0].to(device, non_blocking=True)
            emb = model(data)
            proto = emb[:p].reshape(args.shot, args.train_way, -1).mean(dim=0)
            logits = euclidean_metric(emb[p:], proto)
            loss = F.cross_entropy(logits, label)
            acc = count_acc(logits, label)

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tl.add(loss.detach())
            ta.add(acc)
        lr_scheduler.step()
        tl, ta = tl.item(), ta.item()

        model.eval()
        vl, va = Averager(device), Averager(device)
        vp = args.shot * args.test_way
        with torch.no_grad():
            for batch in val_loader:
                data = batch[0].to(device, non_blocking=True)
                emb = model(data)
                proto = emb[:vp].reshape(args.shot, args.test_way, -1).mean(dim=0)
                logits = euclidean_metric(emb[vp:], proto)
                vl.add(F.cross_entropy(logits, val_label))
                va.add(count_acc(logits, val_label))
        vl, va = vl.item(), va.item()

        if rank == 0:
            print(f"epoch {epoch}, train loss={tl:.4f} acc={ta:.4f}, val loss={vl:.4f} acc={va:.4f}, "
                  f"elapsed {(time.time() - t0) / 60:.1f}m", flush=True)
            if va > trlog["max_acc"]:
                trlog["max_acc"] = va
                save_model("max-acc")
            trlog["train_loss"].append(tl)
            trlog["train_acc"].append(ta)
            trlog["val_loss"].append(vl)
            trlog["val_acc"].append(va)
            torch.save(trlog, osp.join(args.save_path, "trlog"))
            save_model("epoch-last")
            if epoch % args.save_epoch == 0:
                save_model(f"epoch-{epoch}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
