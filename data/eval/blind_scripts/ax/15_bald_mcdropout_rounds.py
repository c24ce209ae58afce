"""Deep Bayesian active learning (BALD with MC dropout) on CIFAR-10.

Each acquisition round continues training from the previous round's weights
(warm start), then scores the pool with BALD using T stochastic forward passes.

    torchrun --nproc_per_node=4 bald_mcdropout_rounds.py --acq-size 2000 --rounds 8
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./data")
    ap.add_argument("--ckpt-dir", default="./ckpt_bald")
    ap.add_argument("--init-size", type=int, default=2000)
    ap.add_argument("--acq-size", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--mc-samples", type=int, default=20)
    ap.add_argument("--pool-subset", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=11)
    return ap.parse_args()


class VGGDropout(nn.Module):
    """VGG-11 features with a dropout classifier used for MC sampling."""

    def __init__(self, p=0.5):
        super().__init__()
        cfg = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]
        layers, c = [], 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(c, v, 3, padding=1), nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
                c = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Dropout(p), nn.Linear(512, 512), nn.ReLU(inplace=True),
            nn.Dropout(p), nn.Linear(512, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


def enable_mc_dropout(net):
    net.eval()
    for m in net.modules():
        if isinstance(m, nn.Dropout):
            m.train()


@torch.no_grad()
def bald_scores(net, dataset, device, T_samples):
    """BALD score of each example of this rank's shard: H[E p] - E[H p]."""
    sampler = DistributedSampler(dataset, shuffle=False)
    loader = DataLoader(dataset, batch_size=500, sampler=sampler, num_workers=4)
    enable_mc_dropout(net)
    idx, scores = list(sampler), []
    for x, _ in loader:
        feats = net.features(x.to(device))
        probs = torch.stack([F.softmax(net.classifier(feats), 1) for _ in range(T_samples)])
        mean = probs.mean(0)
        h_mean = -(mean * mean.clamp_min(1e-10).log()).sum(1)
        mean_h = -(probs * probs.clamp_min(1e-10).log()).sum(2).mean(0)
        scores.append((h_mean - mean_h).cpu())
    return idx, torch.cat(scores).tolist()


@torch.no_grad()
def test_acc(net, loader, device):
    net.eval()
    s = torch.zeros(2, device=device)
    for x, y in loader:
        s[0] += (net(x.to(device)).argmax(1) == y.to(device)).sum()
        s[1] += len(y)
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    train_tf = T.Compose([T.RandomCrop(32, 4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    if rank == 0:
        torchvision.datasets.CIFAR10(args.data, download=True)
        torchvision.datasets.CIFAR10(args.data, train=False, download=True)
        os.makedirs(args.ckpt_dir, exist_ok=True)
    dist.barrier()
    train_set = torchvision.datasets.CIFAR10(args.data, transform=train_tf)
    pool_view = torchvision.datasets.CIFAR10(args.data, transform=test_tf)
    test_set = torchvision.datasets.CIFAR10(args.data, train=False, transform=test_tf)
    test_loader = DataLoader(test_set, batch_size=500, num_workers=4,
                             sampler=DistributedSampler(test_set, shuffle=False))

    rs = np.random.RandomState(args.seed)
    perm = rs.permutation(len(train_set))
    labeled = perm[: args.init_size].tolist()
    pool = perm[args.init_size:].tolist()

    prev_ckpt = None
    for rnd in range(args.rounds):
        t0 = time.time()
        net = VGGDropout()
        if prev_ckpt is not None:
            net.load_state_dict(torch.load(prev_ckpt, map_location="cpu"))
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
        model = DDP(net, device_ids=[local_rank])

        subset = Subset(train_set, labeled)
        sampler = DistributedSampler(subset, shuffle=True, seed=args.seed)
        loader = DataLoader(subset, batch_size=args.batch_size, sampler=sampler,
                            num_workers=4, pin_memory=True, drop_last=True)
        opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=5e-4)
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
        acc = test_acc(model.module, test_loader, device)

        ckpt = os.path.join(args.ckpt_dir, f"round_{rnd:02d}.pt")
        if rank == 0:
            torch.save(model.state_dict(), ckpt)
            np.save(os.path.join(args.ckpt_dir, f"labeled_{rnd:02d}.npy"), np.array(labeled))
            print(f"round {rnd}: n_labeled={len(labeled)} acc={acc:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
        dist.barrier()
        prev_ckpt = ckpt

        # BALD on a random pool subset (same subset on every rank)
        cand = rs.choice(len(pool), min(args.pool_subset, len(pool)), replace=False)
        cand_idx = [pool[i] for i in cand]
        idx, scores = bald_scores(model.module, Subset(pool_view, cand_idx), device, args.mc_samples)
        gathered = [None] * world
        dist.all_gather_object(gathered, (idx, scores))
        best = {}
        for part_idx, part_scores in gathered:
            best.update(zip(part_idx, part_scores))
        ranked = sorted(best, key=lambda k: -best[k])[: args.acq_size]
        picked = {cand_idx[k] for k in ranked}
        labeled += sorted(picked)
        pool = [i for i in pool if i not in picked]

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
