#!/usr/bin/env python
# ProtoNet on CIFAR-FS with a distributed episodic sampler.
#
# The sampler draws one global list of episodes per epoch from a seed shared by
# all ranks and hands each rank a disjoint slice of it, like DistributedSampler
# does for images. That keeps the set of training tasks identical to a
# single-GPU run with the same seed.
#
#   torchrun --nproc_per_node=4 09_protonet_cifarfs_dist_sampler.py --data /data/cifar-fs
import argparse
import math
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision import transforms


class CIFARFS(Dataset):
    # CIFAR-FS pickles from MetaOptNet: CIFAR_FS_{train,val,test}.pickle
    def __init__(self, root, split, train=False):
        with open(os.path.join(root, f"CIFAR_FS_{split}.pickle"), "rb") as f:
            data = pickle.load(f, encoding="latin1")
        self.images = data["data"]
        raw = np.asarray(data["labels"])
        self.classes = np.unique(raw)
        self.labels = np.searchsorted(self.classes, raw)
        mean, std = [0.5071, 0.4865, 0.4409], [0.2673, 0.2564, 0.2762]
        if train:
            self.tf = transforms.Compose([transforms.ToPILImage(), transforms.RandomCrop(32, padding=4),
                                          transforms.ColorJitter(0.4, 0.4, 0.4),
                                          transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                          transforms.Normalize(mean, std)])
        else:
            self.tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.tf(self.images[i]), int(self.labels[i])


class DistributedEpisodeSampler(Sampler):
    def __init__(self, labels, episodes, way, per_class, num_replicas, rank, seed=0):
        self.by_class = [np.flatnonzero(labels == c) for c in range(int(labels.max()) + 1)]
        self.way, self.per_class = way, per_class
        self.num_replicas, self.rank, self.seed = num_replicas, rank, seed
        self.episodes_per_rank = math.ceil(episodes / num_replicas)
        self.total = self.episodes_per_rank * num_replicas
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.episodes_per_rank

    def __iter__(self):
        rng = np.random.default_rng(self.seed + self.epoch)
        episodes = []
        for _ in range(self.total):
            cls = rng.choice(len(self.by_class), self.way, replace=False)
            idx = np.stack([rng.choice(self.by_class[c], self.per_class, replace=False)
                            for c in cls])            # [way, per_class]
            episodes.append(idx.T.reshape(-1).tolist())  # shot-major
        return iter(episodes[self.rank:self.total:self.num_replicas])


class ConvEncoder(nn.Module):
    def __init__(self, hidden=64):
        super().__init__()
        chans = [3, hidden, hidden, hidden, hidden]
        blocks = []
        for cin, cout in zip(chans[:-1], chans[1:]):
            blocks += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                       nn.ReLU(inplace=True), nn.MaxPool2d(2)]
        self.body = nn.Sequential(*blocks)

    def forward(self, x):
        return self.body(x).flatten(1)


def run_episode(model, x, way, shot, query):
    z = model(x)
    z_s, z_q = z[:way * shot], z[way * shot:]
    protos = z_s.view(shot, way, -1).mean(0)
    logits = -torch.cdist(z_q, protos) ** 2
    target = torch.arange(way, device=x.device).repeat(query)
    return F.cross_entropy(logits, target), (logits.argmax(-1) == target).float().mean()


@torch.no_grad()
def meta_test(model, loader, way, shot, query, device):
    model.eval()
    accs = torch.stack([run_episode(model, x.to(device), way, shot, query)[1] for x, _ in loader])
    model.train()
    buf = torch.stack([accs.sum(), accs.square().sum(), torch.tensor(accs.numel(), device=device,
                                                                      dtype=torch.float)])
    dist.all_reduce(buf)
    m = buf[0] / buf[2]
    sd = torch.sqrt(torch.clamp(buf[1] / buf[2] - m * m, min=0.0))
    return m.item(), (1.96 * sd / buf[2].sqrt()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="./checkpoints/proto_cifarfs")
    ap.add_argument("--way", type=int, default=5)
    ap.add_argument("--train-way", type=int, default=20)
    ap.add_argument("--shot", type=int, default=5)
    ap.add_argument("--query", type=int, default=6)
    ap.add_argument("--episodes", type=int, default=1000, help="training episodes per epoch (all GPUs)")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--val-episodes", type=int, default=1000)
    ap.add_argument("--test-episodes", type=int, default=5000)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_ds = CIFARFS(args.data, "train", train=True)
    val_ds = CIFARFS(args.data, "val")
    test_ds = CIFARFS(args.data, "test")
    per = args.shot + args.query
    train_sampler = DistributedEpisodeSampler(train_ds.labels, args.episodes, args.train_way, per,
                                              world, rank, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_sampler=train_sampler, num_workers=6, pin_memory=True)
    val_loader = DataLoader(val_ds, num_workers=6, pin_memory=True,
                            batch_sampler=DistributedEpisodeSampler(val_ds.labels, args.val_episodes,
                                                                    args.way, per, world, rank,
                                                                    seed=2021))
    test_loader = DataLoader(test_ds, num_workers=6, pin_memory=True,
                             batch_sampler=DistributedEpisodeSampler(test_ds.labels, args.test_episodes,
                                                                     args.way, per, world, rank,
                                                                     seed=4242))

    model = DDP(ConvEncoder().to(device), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4,
                                nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    os.makedirs(args.out, exist_ok=True)

    best_acc = 0.0
    for epoch in range(args.epochs):
        start = time.time()
        total = torch.zeros(3, device=device)
        for x, _ in train_loader:
            loss, acc = run_episode(model, x.to(device, non_blocking=True), args.train_way,
                                    args.shot, args.query)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach(), acc, torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(total)
        val_acc, val_ci = meta_test(model, val_loader, args.way, args.shot, args.query, device)
        if rank == 0:
            print(f"[{epoch:03d}] loss={total[0] / total[2]:.4f} acc={total[1] / total[2]:.4f} "
                  f"val={100 * val_acc:.2f}+-{100 * val_ci:.2f} lr={scheduler.get_last_lr()[0]:.4f} "
                  f"t={time.time() - start:.0f}s", flush=True)
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        dist.barrier()

    model.module.load_state_dict(torch.load(os.path.join(args.out, "best.pth"), map_location=device))
    acc, ci = meta_test(model, test_loader, args.way, args.shot, args.query, device)
    if rank == 0:
        print(f"test {args.way}-way {args.shot}-shot: {100 * acc:.2f} +- {100 * ci:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
