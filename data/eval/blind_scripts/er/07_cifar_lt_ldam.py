"""LDAM-DRW on long-tailed CIFAR-10/100 (Cao et al., NeurIPS 2019), multi-GPU with mp.spawn.

    python cifar_lt_ldam.py --dataset cifar100 --imb-factor 0.01 --gpus 4
"""
import argparse
import os
import random
import socket

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", choices=["cifar10", "cifar100"], default="cifar100")
    p.add_argument("--data", default="./data")
    p.add_argument("--imb-factor", type=float, default=0.01)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--drw-epoch", type=int, default=160)
    p.add_argument("--batch-size", type=int, default=128, help="global batch size")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="./ckpt_ldam")
    return p.parse_args()


def make_imbalanced(dataset, num_classes, imb_factor, seed):
    """Exponential profile n_c = n_max * imb_factor^(c / (C-1)), same subset on every rank."""
    targets = np.array(dataset.targets)
    n_max = len(targets) // num_classes
    rng = np.random.RandomState(seed)
    keep = []
    for c in range(num_classes):
        n_c = int(n_max * imb_factor ** (c / (num_classes - 1)))
        idx = np.where(targets == c)[0]
        rng.shuffle(idx)
        keep.extend(idx[:n_c].tolist())
    dataset.data = dataset.data[keep]
    dataset.targets = targets[keep].tolist()
    return np.bincount(dataset.targets, minlength=num_classes)


class NormedLinear(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features).uniform_(-1, 1).renorm_(2, 1, 1e-5).mul_(1e5))

    def forward(self, x):
        return F.normalize(x, dim=1).mm(F.normalize(self.weight, dim=0))


def build_model(num_classes):
    net = torchvision.models.resnet18(num_classes=num_classes)
    net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    net.maxpool = nn.Identity()
    net.fc = NormedLinear(512, num_classes)
    return net


class LDAMLoss(nn.Module):
    def __init__(self, cls_num_list, max_m=0.5, s=30):
        super().__init__()
        m = 1.0 / np.sqrt(np.sqrt(cls_num_list))
        m = m * (max_m / m.max())
        self.register_buffer("m_list", torch.tensor(m, dtype=torch.float32))
        self.s = s

    def forward(self, x, target, weight=None):
        margin = self.m_list[target].unsqueeze(1)
        onehot = F.one_hot(target, x.size(1)).bool()
        x_m = torch.where(onehot, x - margin, x)
        return F.cross_entropy(self.s * x_m, target, weight=weight)


def drw_weights(cls_num_list, epoch, drw_epoch, beta=0.9999):
    if epoch < drw_epoch:
        return None
    eff = 1.0 - np.power(beta, cls_num_list)
    w = (1.0 - beta) / eff
    w = w / w.sum() * len(cls_num_list)
    return torch.tensor(w, dtype=torch.float32).cuda()


def worker(local_rank, world_size, args, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=local_rank, world_size=world_size)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    num_classes = 10 if args.dataset == "cifar10" else 100
    ds_cls = torchvision.datasets.CIFAR10 if args.dataset == "cifar10" else torchvision.datasets.CIFAR100
    mean, std = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)
    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    # the download happened in the parent process
    train_set = ds_cls(args.data, train=True, download=False, transform=train_tf)
    test_set = ds_cls(args.data, train=False, download=False, transform=test_tf)
    cls_num_list = make_imbalanced(train_set, num_classes, args.imb_factor, args.seed)

    per_gpu = args.batch_size // world_size
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=local_rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=per_gpu, sampler=train_sampler, num_workers=4,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    # CIFAR test set is 10k images; every rank evaluates the complete set
    test_loader = DataLoader(test_set, batch_size=500, shuffle=False, num_workers=4)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(build_model(num_classes)).cuda()
    model = DDP(model, device_ids=[local_rank])
    criterion = LDAMLoss(cls_num_list).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=2e-4)

    def lr_at(epoch):
        if epoch < 5:
            return args.lr * (epoch + 1) / 5
        return args.lr * (0.01 if epoch >= 180 else 0.1 if epoch >= 160 else 1.0)

    best = 0.0
    for epoch in range(args.epochs):
        for g in optimizer.param_groups:
            g["lr"] = lr_at(epoch)
        train_sampler.set_epoch(epoch)
        weight = drw_weights(cls_num_list, epoch, args.drw_epoch)
        model.train()
        for x, y in train_loader:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            loss = criterion(model(x), y, weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        model.eval()
        correct = torch.zeros(num_classes, device="cuda")
        with torch.no_grad():
            for x, y in test_loader:
                x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
                pred = model.module(x).argmax(1)
                correct.index_add_(0, y, (pred == y).float())
        per_class = correct / (len(test_set) / num_classes)
        acc = per_class.mean().item()
        if local_rank == 0:
            third = num_classes // 3
            print(f"epoch {epoch} lr {lr_at(epoch):.4f} acc {100 * acc:.2f} "
                  f"head {100 * per_class[:third].mean():.2f} mid {100 * per_class[third:2 * third].mean():.2f} "
                  f"tail {100 * per_class[2 * third:].mean():.2f}", flush=True)
            if acc > best:
                best = acc
                os.makedirs(args.out, exist_ok=True)
                torch.save({"epoch": epoch, "state_dict": model.module.state_dict(), "acc": acc,
                            "cls_num_list": cls_num_list}, os.path.join(args.out, f"{args.dataset}_best.pth"))

    dist.destroy_process_group()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    args = parse_args()
    assert args.batch_size % args.gpus == 0
    ds_cls = torchvision.datasets.CIFAR10 if args.dataset == "cifar10" else torchvision.datasets.CIFAR100
    ds_cls(args.data, train=True, download=True)
    ds_cls(args.data, train=False, download=True)
    mp.spawn(worker, args=(args.gpus, args, free_port()), nprocs=args.gpus, join=True)
