"""Active learning with variation ratios over test-time augmentations.

For every unlabelled image we predict K augmented views and score it by
1 - (count of the modal class) / K. CIFAR-100, ResNet-34 (SyncBN), 8 GPUs.

    torchrun --standalone --nproc_per_node=8 11_variation_ratio_tta.py --tta_views 8
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torchvision import datasets, transforms
from torchvision.models import resnet34

MEAN = (0.5071, 0.4865, 0.4409)
STD = (0.2673, 0.2564, 0.2762)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/datasets/cifar-100")
    p.add_argument("--exp_dir", default="./exp/vr_tta")
    p.add_argument("--init_size", type=int, default=4000)
    p.add_argument("--budget", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch_size", type=int, default=64, help="per GPU")
    p.add_argument("--base_lr", type=float, default=0.1, help="lr at a total batch of 256")
    p.add_argument("--tta_views", type=int, default=8)
    p.add_argument("--seed", type=int, default=3)
    return p.parse_args()


class TTAViews(Dataset):
    """Returns K randomly augmented views of one image: [K, 3, 32, 32]."""

    def __init__(self, base, indices, k):
        self.base, self.indices, self.k = base, indices, k
        self.aug = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                                       transforms.ToTensor(), transforms.Normalize(MEAN, STD)])

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        img, _ = self.base[self.indices[i]]
        return torch.stack([self.aug(img) for _ in range(self.k)]), i


def build_net():
    net = resnet34(num_classes=100)
    net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    net.maxpool = nn.Identity()
    return nn.SyncBatchNorm.convert_sync_batchnorm(net)


def train_round(model, train_set, labelled, args, device, world):
    loader = DataLoader(Subset(train_set, labelled), batch_size=args.batch_size, shuffle=True,
                        num_workers=8, pin_memory=True, drop_last=True)
    lr = args.base_lr * args.batch_size * world / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    warmup = 5 * len(loader)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + np.cos(np.pi * (s - warmup) / (total - warmup))))
    for epoch in range(args.epochs):
        model.train()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    return loss.item()


@torch.no_grad()
def test(net, test_set, device, rank, world):
    sampler = DistributedSampler(test_set, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(test_set, batch_size=500, sampler=sampler, num_workers=4)
    net.eval()
    hit = torch.zeros(2, device=device)
    for x, y in loader:
        y = y.to(device)
        hit[0] += (net(x.to(device)).argmax(1) == y).sum()
        hit[1] += y.numel()
    dist.all_reduce(hit)
    return (hit[0] / hit[1]).item()


@torch.no_grad()
def variation_ratio(net, raw_set, pool, args, device, rank, world):
    ds = TTAViews(raw_set, pool, args.tta_views)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(ds, batch_size=128, sampler=sampler, num_workers=8, pin_memory=True)
    net.eval()
    vr, pos = [], []
    for views, i in loader:
        b, k = views.shape[:2]
        pred = net(views.view(b * k, *views.shape[2:]).to(device, non_blocking=True)).argmax(1).view(b, k)
        mode_count = F.one_hot(pred, 100).sum(1).max(1).values.float()
        vr.append(1.0 - mode_count / k)
        pos.append(i.to(device))
    vr, pos = torch.cat(vr), torch.cat(pos)
    vr_all = [torch.empty_like(vr) for _ in range(world)]
    pos_all = [torch.empty_like(pos) for _ in range(world)]
    dist.all_gather(vr_all, vr)
    dist.all_gather(pos_all, pos)
    score = torch.full((len(pool),), -1.0, device=device)
    score[torch.cat(pos_all)] = torch.cat(vr_all)
    return score


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_tf = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    train_set = datasets.CIFAR100(args.root, train=True, transform=train_tf)
    raw_set = datasets.CIFAR100(args.root, train=True)  # PIL images for the TTA views
    test_set = datasets.CIFAR100(args.root, train=False, transform=test_tf)

    order = np.random.default_rng(args.seed).permutation(len(train_set)).tolist()
    labelled, pool = order[:args.init_size], order[args.init_size:]
    if rank == 0:
        os.makedirs(args.exp_dir, exist_ok=True)
    results = []

    for rnd in range(args.rounds + 1):
        t0 = time.time()
        net = build_net().to(device)
        model = DDP(net, device_ids=[local_rank])
        last_loss = train_round(model, train_set, labelled, args, device, world)
        acc = test(net, test_set, device, rank, world)
        if rank == 0:
            results.append({"round": rnd, "n_labelled": len(labelled), "acc": acc, "last_loss": last_loss,
                            "seconds": round(time.time() - t0)})
            print(results[-1], flush=True)
            with open(os.path.join(args.exp_dir, "results.json"), "w") as f:
                json.dump(results, f, indent=2)
            torch.save({"state_dict": net.state_dict(), "labelled": labelled},
                       os.path.join(args.exp_dir, f"round_{rnd:02d}.pt"))
        if rnd == args.rounds:
            break

        score = variation_ratio(net, raw_set, pool, args, device, rank, world)
        # many ties at the same ratio: break them with a tiny random jitter, identical on every rank
        g = torch.Generator(device=device).manual_seed(args.seed * 100 + rnd)
        score = score + 1e-6 * torch.rand(score.shape, generator=g, device=device)
        top = torch.topk(score, args.budget).indices.tolist()
        picked = set(top)
        labelled = labelled + [pool[j] for j in top]
        pool = [p for j, p in enumerate(pool) if j not in picked]

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
