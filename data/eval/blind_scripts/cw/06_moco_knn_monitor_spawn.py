#!/usr/bin/env python
"""MoCo v2 on ImageNet-100 with a weighted kNN monitor, one process per GPU via mp.spawn.

    python 06_moco_knn_monitor_spawn.py --data /data/imagenet100 --dist-url tcp://127.0.0.1:23456 \
        --nodes 1 --node-rank 0 --out runs/moco_in100
"""
import argparse
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from PIL import ImageFilter
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/moco_in100")
    p.add_argument("--epochs", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=256, help="global")
    p.add_argument("--lr", type=float, default=0.3)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=6, help="per process")
    p.add_argument("--queue", type=int, default=16384)
    p.add_argument("--tau", type=float, default=0.2)
    p.add_argument("--m", type=float, default=0.99)
    p.add_argument("--knn-k", type=int, default=200)
    p.add_argument("--knn-t", type=float, default=0.1)
    p.add_argument("--knn-every", type=int, default=10)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-url", default="tcp://127.0.0.1:23456")
    return p


@torch.no_grad()
def all_gather_cat(x):
    bufs = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(bufs, x)
    return torch.cat(bufs)


class Blur:
    def __call__(self, img):
        return img.filter(ImageFilter.GaussianBlur(radius=random.uniform(0.1, 2.0)))


class Pair:
    def __init__(self, t):
        self.t = t

    def __call__(self, img):
        return self.t(img), self.t(img)


def resnet_embed(dim):
    net = torchvision.models.resnet50()
    h = net.fc.in_features
    net.fc = nn.Sequential(nn.Linear(h, h), nn.ReLU(inplace=True), nn.Linear(h, dim))
    return net


class MoCo(nn.Module):
    def __init__(self, dim=128, K=16384, m=0.99, tau=0.2):
        super().__init__()
        self.K, self.m, self.tau = K, m, tau
        self.q_enc = resnet_embed(dim)
        self.k_enc = resnet_embed(dim)
        self.k_enc.load_state_dict(self.q_enc.state_dict())
        for p in self.k_enc.parameters():
            p.requires_grad = False
        self.register_buffer("queue", F.normalize(torch.randn(K, dim), dim=1))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    def backbone_features(self, x):
        net = self.q_enc
        x = net.maxpool(net.relu(net.bn1(net.conv1(x))))
        x = net.layer4(net.layer3(net.layer2(net.layer1(x))))
        return torch.flatten(net.avgpool(x), 1)

    def forward(self, x_q, x_k):
        q = F.normalize(self.q_enc(x_q), dim=1)
        with torch.no_grad():
            for pq, pk in zip(self.q_enc.parameters(), self.k_enc.parameters()):
                pk.mul_(self.m).add_(pq.detach(), alpha=1 - self.m)
            # shuffle BN: keys computed on a batch permuted across GPUs
            x_all = all_gather_cat(x_k)
            perm = torch.randperm(x_all.shape[0], device=x_k.device)
            dist.broadcast(perm, 0)
            n, r = x_k.shape[0], dist.get_rank()
            k = F.normalize(self.k_enc(x_all[perm[r * n:(r + 1) * n]]), dim=1)
            k_all = all_gather_cat(k)
            k = k_all[torch.argsort(perm)][r * n:(r + 1) * n]
        pos = (q * k).sum(1, keepdim=True)
        neg = q @ self.queue.clone().T
        logits = torch.cat([pos, neg], 1) / self.tau
        with torch.no_grad():
            keys = all_gather_cat(k)
            p = int(self.ptr)
            self.queue[p:p + keys.shape[0]] = keys
            self.ptr.fill_((p + keys.shape[0]) % self.K)
        return F.cross_entropy(logits, torch.zeros(len(q), dtype=torch.long, device=q.device))


@torch.no_grad()
def extract(model, loader, n, gpu):
    feats, labels = None, None
    for x, y, idx in _with_index(loader):
        f = F.normalize(model.backbone_features(x.cuda(gpu, non_blocking=True)), dim=1)
        f, y, idx = all_gather_cat(f), all_gather_cat(y.cuda(gpu)), all_gather_cat(idx.cuda(gpu))
        if feats is None:
            feats = torch.zeros(n, f.shape[1], device=f.device)
            labels = torch.zeros(n, dtype=torch.long, device=f.device)
        feats[idx], labels[idx] = f, y
    return feats, labels


def _with_index(loader):
    sampler_idx = list(iter(loader.sampler))
    bs = loader.batch_size
    for b, (x, y) in enumerate(loader):
        yield x, y, torch.tensor(sampler_idx[b * bs:b * bs + len(x)])


@torch.no_grad()
def knn_eval(model, bank_loader, val_loader, n_bank, n_val, n_cls, args, gpu):
    model.eval()
    bank, bank_y = extract(model, bank_loader, n_bank, gpu)
    val, val_y = extract(model, val_loader, n_val, gpu)
    r, w = dist.get_rank(), dist.get_world_size()
    mine = torch.arange(r, n_val, w, device=bank.device)
    correct = torch.zeros(2, device=bank.device)
    for chunk in mine.split(512):
        sim, idx = (val[chunk] @ bank.T).topk(args.knn_k, dim=1)
        weight = (sim / args.knn_t).exp()
        votes = torch.zeros(len(chunk), n_cls, device=bank.device)
        votes.scatter_add_(1, bank_y[idx], weight)
        correct[0] += (votes.argmax(1) == val_y[chunk]).sum()
        correct[1] += len(chunk)
    dist.all_reduce(correct)
    model.train()
    return (100.0 * correct[0] / correct[1]).item()


def main_worker(gpu, ngpus_per_node, args):
    rank = args.node_rank * ngpus_per_node + gpu
    world_size = args.nodes * ngpus_per_node
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=args.dist_url, world_size=world_size, rank=rank)
    torch.backends.cudnn.benchmark = True

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    aug = T.Compose([T.RandomResizedCrop(224, scale=(0.2, 1.0)), T.RandomApply([T.ColorJitter(0.4, 0.4, 0.4, 0.1)], 0.8),
                     T.RandomGrayscale(0.2), T.RandomApply([Blur()], 0.5), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    plain = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm])
    train_ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), Pair(aug))
    bank_ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), plain)
    val_ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), plain)

    per_gpu = args.batch_size // world_size
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_ds, per_gpu, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    bank_loader = DataLoader(bank_ds, 256, sampler=DistributedSampler(bank_ds, world_size, rank, shuffle=False),
                             num_workers=args.workers, pin_memory=True)
    val_loader = DataLoader(val_ds, 256, sampler=DistributedSampler(val_ds, world_size, rank, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    model = MoCo(K=args.queue, m=args.m, tau=args.tau).cuda(gpu)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[gpu])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for g in opt.param_groups:
            g["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * epoch / args.epochs))
        model.train()
        t0, tot = time.time(), torch.zeros(2, device=f"cuda:{gpu}")
        for (x1, x2), _ in train_loader:
            loss = model(x1.cuda(gpu, non_blocking=True), x2.cuda(gpu, non_blocking=True))
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones_like(loss)])
        dist.all_reduce(tot)
        msg = f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} time {time.time() - t0:.0f}s"
        if (epoch + 1) % args.knn_every == 0 or epoch + 1 == args.epochs:
            acc = knn_eval(model.module, bank_loader, val_loader, len(bank_ds), len(val_ds),
                           len(train_ds.classes), args, gpu)
            msg += f" knn@{args.knn_k} {acc:.2f}"
        if rank == 0:
            print(msg, flush=True)
            torch.save({"epoch": epoch + 1, "model": model.module.state_dict(), "opt": opt.state_dict()},
                       os.path.join(args.out, "last.pth"))
    dist.destroy_process_group()


def main():
    args = get_parser().parse_args()
    ngpus_per_node = torch.cuda.device_count()
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(args, ngpus_per_node))


if __name__ == "__main__":
    main()
