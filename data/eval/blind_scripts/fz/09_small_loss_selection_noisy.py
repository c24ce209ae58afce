"""Self-paced small-loss selection for learning with noisy labels (CIFAR-10,
symmetric / asymmetric synthetic noise), DDP.

The remember rate R(t) decays from 1 to 1 - tau over `--tk` epochs.  Each
epoch the whole (noisy) training set is scored, and only the R(t) fraction with
the smallest loss is used for training.

    torchrun --nproc_per_node=2 09_small_loss_selection_noisy.py --noise 0.4 --noise-type sym
"""
import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class NoisyCIFAR10(Dataset):
    def __init__(self, base, noisy_targets):
        self.base = base
        self.targets = noisy_targets

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        img, _ = self.base[i]
        return img, int(self.targets[i]), i


def corrupt(targets, rate, kind, seed):
    # fixed RandomState: every rank builds exactly the same noisy labels
    rs = np.random.RandomState(seed)
    targets = np.array(targets)
    noisy = targets.copy()
    flip = rs.rand(len(targets)) < rate
    if kind == "sym":
        noisy[flip] = rs.randint(0, 10, flip.sum())
    else:  # truck->automobile, bird->airplane, deer->horse, cat<->dog
        mapping = {9: 1, 2: 0, 4: 7, 3: 5, 5: 3}
        for i in np.where(flip)[0]:
            noisy[i] = mapping.get(targets[i], targets[i])
    return noisy


def conv_bn(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.LeakyReLU(0.01))


class CNN9(nn.Module):
    """The 9-layer CNN used in the co-teaching papers."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.features = nn.Sequential(
            conv_bn(3, 128), conv_bn(128, 128), conv_bn(128, 128), nn.MaxPool2d(2), nn.Dropout(0.25),
            conv_bn(128, 256), conv_bn(256, 256), conv_bn(256, 256), nn.MaxPool2d(2), nn.Dropout(0.25),
            conv_bn(256, 512), conv_bn(512, 256), conv_bn(256, 128), nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(128, num_classes)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


@torch.no_grad()
def global_losses(model, loader, n, device):
    """Per-sample loss for the whole training set, identical on every rank."""
    model.eval()
    table = torch.zeros(n, device=device)
    for x, y, idx in loader:
        x, y, idx = x.to(device), y.to(device), idx.to(device)
        table[idx] = F.cross_entropy(model(x), y, reduction="none")
    # shards are disjoint (strided, unpadded), so a sum puts every loss in place
    dist.all_reduce(table)
    return table


@torch.no_grad()
def test_acc(model, loader, device):
    model.eval()
    t = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        t[0] += (model(x).argmax(1) == y).sum()
        t[1] += y.numel()
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="./data")
    ap.add_argument("--noise", type=float, default=0.4)
    ap.add_argument("--noise-type", default="sym", choices=["sym", "asym"])
    ap.add_argument("--tau", type=float, default=None, help="forget rate, defaults to the noise rate")
    ap.add_argument("--tk", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ckpt", default="checkpoints/small_loss.pt")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    tau = args.noise if args.tau is None else args.tau

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    aug = T.Compose([T.RandomCrop(32, 4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
    plain = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    if rank == 0:
        torchvision.datasets.CIFAR10(args.root, train=True, download=True)
        torchvision.datasets.CIFAR10(args.root, train=False, download=True)
    dist.barrier()
    base_train = torchvision.datasets.CIFAR10(args.root, train=True, transform=aug)
    base_score = torchvision.datasets.CIFAR10(args.root, train=True, transform=plain)
    test = torchvision.datasets.CIFAR10(args.root, train=False, transform=plain)
    noisy = corrupt(base_train.targets, args.noise, args.noise_type, seed=args.seed)
    train_set = NoisyCIFAR10(base_train, noisy)
    score_set = NoisyCIFAR10(base_score, noisy)
    n = len(train_set)
    clean_mask = torch.as_tensor(noisy == np.array(base_train.targets), device=device)

    score_loader = DataLoader(Subset(score_set, range(rank, n, world)), batch_size=512, num_workers=4)
    test_loader = DataLoader(Subset(test, range(rank, len(test), world)), batch_size=512, num_workers=4)

    torch.manual_seed(args.seed)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(CNN9()).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    start = 0
    if os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, map_location={"cuda:0": f"cuda:{local_rank}"})
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        start = state["epoch"] + 1

    for epoch in range(start, args.epochs):
        remember = 1.0 - tau * min(1.0, epoch / args.tk)
        if remember < 1.0:
            losses = global_losses(model.module, score_loader, n, device)
            k = int(remember * n)
            selected = losses.topk(k, largest=False).indices.sort().values
        else:
            selected = torch.arange(n, device=device)
        precision = clean_mask[selected].float().mean().item()

        # the selection is the same on every rank; DistributedSampler splits it evenly
        subset = Subset(train_set, selected.cpu().tolist())
        sampler = DistributedSampler(subset, shuffle=True, seed=args.seed)
        sampler.set_epoch(epoch)
        loader = DataLoader(subset, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                            pin_memory=True, drop_last=True)

        model.train()
        for x, y, _ in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        acc = test_acc(model.module, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch:3d} remember {remember:.2f} selected {len(selected)} "
                  f"label_precision {precision:.3f} test_acc {acc:.4f}", flush=True)
            os.makedirs(os.path.dirname(args.ckpt) or ".", exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optim": optimizer.state_dict(), "epoch": epoch},
                       args.ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
