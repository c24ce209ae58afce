"""Temporal Ensembling (Laine & Aila, ICLR 2017) on CIFAR-10 / SVHN, multi-GPU.

Each training sample keeps an exponential moving average Z of the network's past
predictions (accumulated once per epoch); the bias-corrected Z is the target of the
unsupervised MSE term.  Predictions from all GPUs are gathered every step so that
every rank keeps the same Z.

    torchrun --nproc_per_node=2 18_temporal_ensembling.py --dataset cifar10 --num-labels 4000
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="cifar10", choices=["cifar10", "svhn"])
    p.add_argument("--root", default="./data")
    p.add_argument("--out", default="./te_runs")
    p.add_argument("--num-labels", type=int, default=4000)
    p.add_argument("--batch-size", type=int, default=50, help="per GPU; 2 GPUs = the paper's 100")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--max-lr", type=float, default=0.003)
    p.add_argument("--rampup", type=int, default=80)
    p.add_argument("--rampdown", type=int, default=50)
    p.add_argument("--max-w", type=float, default=30.0)
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=2017)
    return p.parse_args()


def gaussian_noise(x, std=0.15):
    return x + torch.randn_like(x) * std


class PiNet(nn.Module):
    """The conv-large network of the paper with weight-normalised layers."""

    def __init__(self, num_classes=10):
        super().__init__()
        wn = nn.utils.weight_norm

        def block(cin, cout, k, pad):
            return [wn(nn.Conv2d(cin, cout, k, padding=pad)), nn.BatchNorm2d(cout), nn.LeakyReLU(0.1)]

        layers = block(3, 128, 3, 1) + block(128, 128, 3, 1) + block(128, 128, 3, 1)
        layers += [nn.MaxPool2d(2), nn.Dropout(0.5)]
        layers += block(128, 256, 3, 1) + block(256, 256, 3, 1) + block(256, 256, 3, 1)
        layers += [nn.MaxPool2d(2), nn.Dropout(0.5)]
        layers += block(256, 512, 3, 0) + block(512, 256, 1, 0) + block(256, 128, 1, 0)
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.body = nn.Sequential(*layers)
        self.fc = wn(nn.Linear(128, num_classes))

    def forward(self, x):
        if self.training:
            x = gaussian_noise(x)
        return self.fc(self.body(x))


class SemiDataset(Dataset):
    """Whole training set; labels of the unlabelled part are replaced by -1."""

    def __init__(self, base, labeled_mask):
        self.base = base
        self.labeled_mask = labeled_mask

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return i, x, (int(y) if self.labeled_mask[i] else -1)


def ramp_weight(epoch, args):
    if epoch < args.rampup:
        p = 1.0 - epoch / args.rampup
        return float(np.exp(-5.0 * p * p))
    return 1.0


def lr_at(epoch, args):
    lr = args.max_lr * ramp_weight(epoch, args)
    if epoch >= args.epochs - args.rampdown:
        p = (epoch - (args.epochs - args.rampdown)) * 0.5
        lr *= float(np.exp(-(p * p) / args.rampdown))
    return lr


@torch.no_grad()
def gather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = total = 0
    for x, y in loader:
        pred = model(x.to(device)).argmax(1).cpu()
        correct += (pred == y).sum().item()
        total += y.numel()
    stats = torch.tensor([correct, total], dtype=torch.float64)
    dist.all_reduce(stats)
    return 100.0 * stats[0].item() / stats[1].item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    if args.dataset == "cifar10":
        mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
        tf = transforms.Compose([transforms.RandomCrop(32, padding=2, padding_mode="reflect"),
                                 transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                 transforms.Normalize(mean, std)])
        test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
        if rank == 0:
            datasets.CIFAR10(args.root, train=True, download=True)
            datasets.CIFAR10(args.root, train=False, download=True)
        dist.barrier()
        base = datasets.CIFAR10(args.root, train=True, transform=tf)
        test_set = datasets.CIFAR10(args.root, train=False, transform=test_tf)
        targets = np.asarray(base.targets)
    else:
        mean, std = (0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)
        tf = transforms.Compose([transforms.RandomCrop(32, padding=2), transforms.ToTensor(),
                                 transforms.Normalize(mean, std)])
        test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
        if rank == 0:
            datasets.SVHN(args.root, split="train", download=True)
            datasets.SVHN(args.root, split="test", download=True)
        dist.barrier()
        base = datasets.SVHN(args.root, split="train", transform=tf)
        test_set = datasets.SVHN(args.root, split="test", transform=test_tf)
        targets = np.asarray(base.labels)

    rng = np.random.RandomState(args.seed)
    labeled_mask = np.zeros(len(targets), dtype=bool)
    for c in range(10):
        labeled_mask[rng.choice(np.flatnonzero(targets == c), args.num_labels // 10, replace=False)] = True
    train_set = SemiDataset(base, labeled_mask)

    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, range(rank, len(test_set), world)),
                             batch_size=500, num_workers=4)

    model = DDP(PiNet().to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.max_lr, betas=(0.9, 0.999))

    n = len(train_set)
    Z = torch.zeros(n, 10, device=device)        # ensemble predictions
    z_epoch = torch.zeros(n, 10, device=device)  # predictions of the current epoch
    targets_te = torch.zeros(n, 10, device=device)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        lr = lr_at(epoch, args)
        for g in optimizer.param_groups:
            g["lr"] = lr
            g["betas"] = (0.9 if epoch < args.epochs - args.rampdown else 0.5, 0.999)
        w = args.max_w * args.num_labels / len(train_set) * ramp_weight(epoch, args)
        t0 = time.time()
        for idx, x, y in loader:
            idx, x, y = idx.to(device), x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)
            probs = F.softmax(out, dim=1)
            labeled = y >= 0
            sup = F.cross_entropy(out[labeled], y[labeled], reduction="sum") / x.size(0)
            unsup = F.mse_loss(probs, targets_te[idx], reduction="mean")
            loss = sup + w * unsup

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

            all_idx, all_probs = gather(idx), gather(probs.detach())
            z_epoch[all_idx] = all_probs

        Z = args.alpha * Z + (1 - args.alpha) * z_epoch
        targets_te = Z / (1 - args.alpha ** (epoch + 1))

        acc = evaluate(model.module, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch} lr {lr:.5f} w {w:.3f} loss {loss.item():.4f} "
                  f"sup {sup.item():.4f} unsup {unsup.item():.5f} test {acc:.2f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "Z": Z.cpu(), "epoch": epoch + 1}, os.path.join(args.out, "last.pt"))
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
