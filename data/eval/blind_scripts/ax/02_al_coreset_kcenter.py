"""Core-set active learning (k-center greedy) on CIFAR-10, multi-GPU.

Features of the labelled + unlabelled pool are extracted in parallel (each rank
embeds its shard), gathered, and rank 0 runs k-center greedy; the new indices
are broadcast so that every rank trains on the same labelled set.

    torchrun --nproc_per_node=8 al_coreset_kcenter.py --config configs/coreset.yaml
"""
import argparse
import os
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
import torchvision
import torchvision.transforms as T

DEFAULTS = dict(
    data="./data", out="./runs/coreset", init_labeled=5000, budget=2500,
    rounds=6, epochs=100, batch_size=128, base_lr=0.1, wd=5e-4, workers=6,
    seed=1, resume=True,
)


def load_config():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=None)
    args = p.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    return argparse.Namespace(**cfg)


class Net(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        r = torchvision.models.resnet18(num_classes=num_classes)
        r.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        r.maxpool = nn.Identity()
        self.fc = r.fc
        r.fc = nn.Identity()
        self.backbone = r

    def embed(self, x):
        return self.backbone(x)

    def forward(self, x):
        return self.fc(self.backbone(x))


@torch.no_grad()
def gather_embeddings(net, dataset, device, world_size):
    """Embeds the whole dataset across ranks; returns (N, D) on every rank."""
    sampler = DistributedSampler(dataset, shuffle=False)
    loader = DataLoader(dataset, batch_size=512, sampler=sampler, num_workers=4)
    net.eval()
    local_idx = torch.tensor(list(iter(sampler)), device=device)
    feats = []
    for x, _ in loader:
        feats.append(net.embed(x.to(device, non_blocking=True)))
    feats = torch.cat(feats)
    # DistributedSampler pads every shard to the same length, so the gather is even
    all_feats = [torch.empty_like(feats) for _ in range(world_size)]
    all_idx = [torch.empty_like(local_idx) for _ in range(world_size)]
    dist.all_gather(all_feats, feats)
    dist.all_gather(all_idx, local_idx)
    all_feats = torch.cat(all_feats)
    all_idx = torch.cat(all_idx)
    out = torch.empty(len(dataset), feats.size(1), device=device)
    out[all_idx] = all_feats  # padded duplicates just overwrite the same row
    return out


def kcenter_greedy(feats, labeled, budget):
    n = feats.size(0)
    is_lab = torch.zeros(n, dtype=torch.bool, device=feats.device)
    is_lab[labeled] = True
    min_dist = torch.full((n,), float("inf"), device=feats.device)
    for chunk in torch.split(torch.tensor(labeled, device=feats.device), 1024):
        d = torch.cdist(feats, feats[chunk]).min(dim=1).values
        min_dist = torch.minimum(min_dist, d)
    picked = []
    for _ in range(budget):
        min_dist[is_lab] = -1
        i = int(torch.argmax(min_dist))
        picked.append(i)
        is_lab[i] = True
        min_dist = torch.minimum(min_dist, torch.cdist(feats, feats[i:i + 1]).squeeze(1))
    return picked


def train(model, train_set, labeled, cfg, device, rank, world_size):
    subset = Subset(train_set, labeled)
    sampler = DistributedSampler(subset, shuffle=True, seed=cfg.seed)
    loader = DataLoader(subset, batch_size=cfg.batch_size, sampler=sampler,
                        num_workers=cfg.workers, pin_memory=True, drop_last=True,
                        persistent_workers=True)
    # linear scaling rule: base_lr is for a global batch of 128
    lr = cfg.base_lr * cfg.batch_size * world_size / 128
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=cfg.wd)
    steps = cfg.epochs * len(loader)
    warmup = 5 * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + np.cos(np.pi * s / steps)))
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        if rank == 0 and epoch % 20 == 0:
            print(f"    ep {epoch} loss {loss.item():.3f} lr {sched.get_last_lr()[0]:.4f}")


@torch.no_grad()
def test_accuracy(net, loader, device):
    net.eval()
    stats = torch.zeros(2, device=device)
    for x, y in loader:
        pred = net(x.to(device)).argmax(1)
        stats[0] += (pred == y.to(device)).sum()
        stats[1] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=timedelta(minutes=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg.seed)

    norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    aug = T.Compose([T.RandomCrop(32, 4), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    plain = T.Compose([T.ToTensor(), norm])
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        torchvision.datasets.CIFAR10(cfg.data, train=True, download=True)
        torchvision.datasets.CIFAR10(cfg.data, train=False, download=True)
    dist.barrier()
    train_set = torchvision.datasets.CIFAR10(cfg.data, train=True, transform=aug)
    embed_set = torchvision.datasets.CIFAR10(cfg.data, train=True, transform=plain)
    test_set = torchvision.datasets.CIFAR10(cfg.data, train=False, transform=plain)
    test_loader = DataLoader(test_set, batch_size=512, num_workers=4,
                             sampler=DistributedSampler(test_set, shuffle=False))

    state_path = os.path.join(cfg.out, "al_state.pt")
    start_round = 0
    if cfg.resume and os.path.exists(state_path):
        st = torch.load(state_path, map_location="cpu")
        labeled, start_round = st["labeled"], st["round"] + 1
        if rank == 0:
            print(f"resuming at round {start_round} with {len(labeled)} labels")
    else:
        rng = np.random.default_rng(cfg.seed)
        labeled = rng.choice(len(train_set), cfg.init_labeled, replace=False).tolist()

    for rnd in range(start_round, cfg.rounds):
        t0 = time.time()
        net = Net().to(device)
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
        model = DDP(net, device_ids=[local_rank])
        train(model, train_set, labeled, cfg, device, rank, world_size)
        acc = test_accuracy(model.module, test_loader, device)

        feats = gather_embeddings(model.module, embed_set, device, world_size)
        if rank == 0:
            picked = kcenter_greedy(feats, labeled, cfg.budget)
        else:
            picked = None
        obj = [picked]
        dist.broadcast_object_list(obj, src=0)
        labeled = labeled + obj[0]

        if rank == 0:
            torch.save(model.module.state_dict(), os.path.join(cfg.out, f"model_r{rnd}.pt"))
            tmp = state_path + ".tmp"
            torch.save({"labeled": labeled, "round": rnd}, tmp)
            os.replace(tmp, state_path)
            print(f"[round {rnd}] acc={acc:.4f} labeled->{len(labeled)} "
                  f"time={time.time() - t0:.0f}s")
        dist.barrier()
        del model, net, feats
        torch.cuda.empty_cache()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
