#!/usr/bin/env python
# Instance discrimination with a non-parametric memory bank (one 128-d slot per training image)
# for unsupervised product retrieval pre-training. One process per GPU, started with mp.spawn.
#
# single node:  python 15_instance_memory_bank_spawn.py /data/products --world-size 1 --rank 0 \
#                   --dist-url tcp://127.0.0.1:29511
# two nodes:    same command on each node with --world-size 2 --rank {0,1} --dist-url tcp://node0:29511
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser(description="memory-bank instance discrimination")
parser.add_argument("data", help="folder with train/ and test/ in ImageFolder layout")
parser.add_argument("--epochs", type=int, default=200)
parser.add_argument("--batch-size", type=int, default=256, help="total batch size of all GPUs on all nodes")
parser.add_argument("--lr", type=float, default=0.03)
parser.add_argument("--workers", type=int, default=32, help="total loader workers on the node")
parser.add_argument("--low-dim", type=int, default=128)
parser.add_argument("--nce-k", type=int, default=4096)
parser.add_argument("--nce-t", type=float, default=0.07)
parser.add_argument("--bank-m", type=float, default=0.5)
parser.add_argument("--world-size", type=int, default=1, help="number of nodes for distributed training")
parser.add_argument("--rank", type=int, default=0, help="node rank for distributed training")
parser.add_argument("--dist-url", default="tcp://127.0.0.1:29511")
parser.add_argument("--save-dir", default="checkpoints/membank")
parser.add_argument("--eval-freq", type=int, default=10)


class WithIndex(Dataset):
    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x, y, i


@torch.no_grad()
def gather_cat(t):
    bufs = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(bufs, t)
    return torch.cat(bufs)


class MemoryBank(nn.Module):
    def __init__(self, n, dim, k, t, m):
        super().__init__()
        self.k, self.t, self.m = k, t, m
        stdv = 1.0 / math.sqrt(dim / 3)
        self.register_buffer("bank", F.normalize(torch.rand(n, dim).mul_(2 * stdv).add_(-stdv), dim=1))

    def forward(self, feat, idx):
        b = feat.shape[0]
        neg_idx = torch.randint(0, self.bank.shape[0], (b, self.k), device=feat.device)
        neg_idx[:, 0] = idx
        w = self.bank[neg_idx].detach()  # [b, k, d]; column 0 is the positive
        logits = torch.bmm(w, feat.unsqueeze(2)).squeeze(2) / self.t
        return F.cross_entropy(logits, torch.zeros(b, dtype=torch.long, device=feat.device))

    @torch.no_grad()
    def update(self, feat, idx):
        feat, idx = gather_cat(feat), gather_cat(idx)
        new = self.bank[idx] * self.m + feat * (1 - self.m)
        self.bank[idx] = F.normalize(new, dim=1)


def build_net(low_dim):
    net = torchvision.models.resnet50()
    net.fc = nn.Linear(2048, low_dim)
    return nn.SyncBatchNorm.convert_sync_batchnorm(net)


@torch.no_grad()
def recall_at_k(net, test_loader, n_test, gpu, ks=(1, 10, 100)):
    net.eval()
    feats, labels, idxs = [], [], []
    for x, y, i in test_loader:
        feats.append(F.normalize(net(x.cuda(gpu, non_blocking=True)), dim=1))
        labels.append(y.cuda(gpu))
        idxs.append(i.cuda(gpu))
    f, y, i = gather_cat(torch.cat(feats)), gather_cat(torch.cat(labels)), gather_cat(torch.cat(idxs))
    all_f = torch.zeros(n_test, f.shape[1], device=f.device)
    all_y = torch.zeros(n_test, dtype=torch.long, device=f.device)
    all_f[i], all_y[i] = f, y
    rank, world = dist.get_rank(), dist.get_world_size()
    q = torch.arange(rank, n_test, world, device=f.device)
    stats = torch.zeros(len(ks) + 1, device=f.device)
    for chunk in q.split(1024):
        s = all_f[chunk] @ all_f.T
        s[torch.arange(len(chunk)), chunk] = -2
        nn_y = all_y[s.topk(max(ks), dim=1).indices]
        for j, k in enumerate(ks):
            stats[j] += (nn_y[:, :k] == all_y[chunk, None]).any(1).sum()
        stats[-1] += len(chunk)
    dist.all_reduce(stats)
    net.train()
    return [100 * (stats[j] / stats[-1]).item() for j in range(len(ks))]


def main():
    args = parser.parse_args()
    ngpus_per_node = torch.cuda.device_count()
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))


def main_worker(gpu, ngpus_per_node, args):
    args.gpu = gpu
    args.rank = args.rank * ngpus_per_node + gpu
    torch.cuda.set_device(gpu)
    dist.init_process_group(backend="nccl", init_method=args.dist_url,
                            world_size=args.world_size, rank=args.rank)
    is_main = args.rank == 0

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    aug = T.Compose([T.RandomResizedCrop(224, scale=(0.2, 1.0)), T.RandomGrayscale(0.2),
                     T.ColorJitter(0.4, 0.4, 0.4, 0.4), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    plain = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm])
    train_ds = WithIndex(torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), aug))
    test_ds = WithIndex(torchvision.datasets.ImageFolder(os.path.join(args.data, "test"), plain))

    args.batch_size = args.batch_size // (ngpus_per_node * args.world_size)
    args.workers = (args.workers + ngpus_per_node - 1) // ngpus_per_node
    train_sampler = DistributedSampler(train_ds)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=256, sampler=DistributedSampler(test_ds, shuffle=False),
                             num_workers=args.workers, pin_memory=True)

    net = build_net(args.low_dim).cuda(gpu)
    net = nn.parallel.DistributedDataParallel(net, device_ids=[gpu])
    bank = MemoryBank(len(train_ds), args.low_dim, args.nce_k, args.nce_t, args.bank_m).cuda(gpu)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)

    start_epoch = 0
    last = os.path.join(args.save_dir, "last.pth")
    if os.path.isfile(last):
        ck = torch.load(last, map_location=f"cuda:{gpu}")
        net.module.load_state_dict(ck["net"])
        bank.load_state_dict(ck["bank"])
        optimizer.load_state_dict(ck["optimizer"])
        start_epoch = ck["epoch"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * epoch / args.epochs))
        for g in optimizer.param_groups:
            g["lr"] = lr
        net.train()
        t0 = time.time()
        meter = torch.zeros(2, device=f"cuda:{gpu}")
        for x, _, idx in train_loader:
            x, idx = x.cuda(gpu, non_blocking=True), idx.cuda(gpu, non_blocking=True)
            feat = F.normalize(net(x), dim=1)
            loss = bank(feat, idx)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            bank.update(feat.detach(), idx)
            meter += torch.stack([loss.detach(), torch.ones_like(loss)])
        dist.all_reduce(meter)
        msg = f"epoch {epoch} lr {lr:.4f} loss {(meter[0] / meter[1]).item():.4f} ({time.time() - t0:.0f}s)"
        if (epoch + 1) % args.eval_freq == 0:
            r = recall_at_k(net.module, test_loader, len(test_ds), gpu)
            msg += " R@1/10/100 " + "/".join(f"{v:.2f}" for v in r)
        if is_main:
            print(msg, flush=True)
            os.makedirs(args.save_dir, exist_ok=True)
            torch.save({"net": net.module.state_dict(), "bank": bank.state_dict(),
                        "optimizer": optimizer.state_dict(), "epoch": epoch + 1}, last + ".tmp")
            os.replace(last + ".tmp", last)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
