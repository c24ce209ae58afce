"""Core-set active learning (Sener & Savarese, 2018) on CIFAR-100, multi-GPU.

Embeddings of the whole training set are computed in shards on every rank and
gathered; rank 0 runs k-center greedy and broadcasts the chosen indices.

Launch:
    torchrun --standalone --nproc_per_node=8 02_coreset_cifar100.py --out_dir runs/coreset_c100
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms
from torchvision.models import resnet18

MEAN, STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)


class ResNetAL(nn.Module):
    def __init__(self, num_classes=100):
        super().__init__()
        backbone = resnet18(num_classes=num_classes)
        backbone.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        backbone.maxpool = nn.Identity()
        self.fc = backbone.fc
        backbone.fc = nn.Identity()
        self.backbone = backbone

    def embed(self, x):
        return self.backbone(x)

    def forward(self, x):
        return self.fc(self.backbone(x))


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", default="/datasets/cifar100")
    ap.add_argument("--out_dir", required=True)
    ap.add_argument("--init_size", type=int, default=5000)
    ap.add_argument("--budget", type=int, default=2500)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--per_gpu_batch", type=int, default=32)
    ap.add_argument("--base_lr", type=float, default=0.025, help="lr for a batch of 128")
    ap.add_argument("--wd", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--resume", default="")
    return ap.parse_args()


def shard_padded(indices, rank, world_size):
    """Contiguous shard of `indices`; the tail is padded so every rank gets the same length."""
    per_rank = math.ceil(len(indices) / world_size)
    padded = indices + indices[: per_rank * world_size - len(indices)]
    return padded[rank * per_rank:(rank + 1) * per_rank]


@torch.no_grad()
def gather_embeddings(net, dataset, n, rank, world_size, device):
    """Returns [n, D] embeddings of the full training set on every rank."""
    my_idx = shard_padded(list(range(n)), rank, world_size)
    loader = DataLoader(Subset(dataset, my_idx), batch_size=1024, shuffle=False,
                        num_workers=6, pin_memory=True)
    net.eval()
    feats = torch.cat([net.embed(x.to(device, non_blocking=True)) for x, _ in loader])
    idx = torch.tensor(my_idx, device=device)
    all_feats = [torch.empty_like(feats) for _ in range(world_size)]
    all_idx = [torch.empty_like(idx) for _ in range(world_size)]
    dist.all_gather(all_feats, feats)
    dist.all_gather(all_idx, idx)
    out = torch.empty(n, feats.size(1), device=device)
    out[torch.cat(all_idx)] = torch.cat(all_feats)  # padded duplicates just overwrite themselves
    return out


@torch.no_grad()
def k_center_greedy(feats, labelled, k):
    min_dist = torch.full((feats.size(0),), float("inf"), device=feats.device)
    centers = feats[torch.tensor(labelled, device=feats.device)]
    for chunk in centers.split(2048):
        min_dist = torch.minimum(min_dist, torch.cdist(feats, chunk).min(dim=1).values)
    chosen = []
    for _ in range(k):
        i = int(torch.argmax(min_dist))
        chosen.append(i)
        min_dist = torch.minimum(min_dist, torch.cdist(feats, feats[i:i + 1]).squeeze(1))
        min_dist[i] = 0.0
    return chosen


def train(model, dataset, labelled, args, device, world_size, rank):
    ds = Subset(dataset, labelled)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.per_gpu_batch, sampler=sampler, num_workers=6,
                        pin_memory=True, persistent_workers=False)
    # linear scaling rule w.r.t. the global batch
    lr = args.base_lr * args.per_gpu_batch * world_size / 128
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[int(args.epochs * 0.6), int(args.epochs * 0.8)])
    model.train()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        running = torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += torch.stack([loss.detach() * y.size(0), torch.tensor(float(y.size(0)), device=device)])
        sched.step()
        if (epoch + 1) % 50 == 0:
            dist.all_reduce(running)
            if rank == 0:
                print(f"  epoch {epoch + 1}: loss {running[0].item() / running[1].item():.4f}", flush=True)


@torch.no_grad()
def test_accuracy(net, test_set, device, rank, world_size):
    sampler = DistributedSampler(test_set, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(test_set, batch_size=500, sampler=sampler, num_workers=4)
    net.eval()
    stats = torch.zeros(2, device=device)
    for x, y in loader:
        pred = net(x.to(device)).argmax(1)
        stats[0] += (pred == y.to(device)).sum()
        stats[1] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    norm = transforms.Normalize(MEAN, STD)
    train_tf = transforms.Compose([transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    plain_tf = transforms.Compose([transforms.ToTensor(), norm])
    train_set = datasets.CIFAR100(args.data_dir, train=True, transform=train_tf)
    embed_set = datasets.CIFAR100(args.data_dir, train=True, transform=plain_tf)
    test_set = datasets.CIFAR100(args.data_dir, train=False, transform=plain_tf)
    n = len(train_set)

    start_round = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        labelled = ckpt["labelled"]
        start_round = ckpt["round"] + 1
    else:
        g = np.random.default_rng(args.seed)  # same seed on every rank -> same initial set
        labelled = sorted(g.choice(n, args.init_size, replace=False).tolist())

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
    log = []
    for rnd in range(start_round, args.rounds + 1):
        t0 = time.time()
        net = nn.SyncBatchNorm.convert_sync_batchnorm(ResNetAL(100)).to(device)
        model = DDP(net, device_ids=[local_rank], output_device=local_rank)
        train(model, train_set, labelled, args, device, world_size, rank)
        acc = test_accuracy(net, test_set, device, rank, world_size)

        if rank == 0:
            print(f"round {rnd} | labelled {len(labelled)} | acc {acc:.4f} | {time.time() - t0:.0f}s", flush=True)
            log.append({"round": rnd, "labelled": len(labelled), "acc": acc})
            torch.save({"model": net.state_dict(), "labelled": labelled, "round": rnd},
                       os.path.join(args.out_dir, "last.pt"))
            with open(os.path.join(args.out_dir, "log.json"), "a") as f:
                f.write(json.dumps(log[-1]) + "\n")
        if rnd == args.rounds:
            break

        feats = gather_embeddings(model.module, embed_set, n, rank, world_size, device)
        chosen = torch.empty(args.budget, dtype=torch.long, device=device)
        if rank == 0:
            chosen.copy_(torch.tensor(k_center_greedy(feats, labelled, args.budget), device=device))
        dist.broadcast(chosen, src=0)
        labelled = sorted(set(labelled) | set(chosen.tolist()))
        del feats, model, net
        torch.cuda.empty_cache()

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
