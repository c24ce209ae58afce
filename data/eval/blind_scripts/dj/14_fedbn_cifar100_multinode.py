"""FedBN on CIFAR-100: BatchNorm layers stay local, everything else is averaged.

Each process is one client with a Dirichlet(alpha) label-skewed partition.
Because BatchNorm statistics and affine parameters are kept per client
(Li et al., ICLR 2021), each client evaluates the global model with its own
BN layers; we report the mean of the per-client test accuracies.

Two 8-GPU nodes (16 clients):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$HEAD_NODE:29500 14_fedbn_cifar100_multinode.py
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
from torch.utils.data import DataLoader, Subset


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/shared/data/cifar100")
    p.add_argument("--out", default="/shared/exp/fedbn_c100")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--local_epochs", type=int, default=1)
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=31)
    p.add_argument("--eval_every", type=int, default=5)
    return p.parse_args()


def init_distributed():
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = torch.cuda.device_count()
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    return rank, local_rank, world_size


def conv_bn(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class Res9(nn.Module):
    def __init__(self, num_classes=100):
        super().__init__()
        self.prep = conv_bn(3, 64)
        self.layer1 = nn.Sequential(conv_bn(64, 128), nn.MaxPool2d(2))
        self.res1 = nn.Sequential(conv_bn(128, 128), conv_bn(128, 128))
        self.layer2 = nn.Sequential(conv_bn(128, 256), nn.MaxPool2d(2))
        self.layer3 = nn.Sequential(conv_bn(256, 512), nn.MaxPool2d(2))
        self.res3 = nn.Sequential(conv_bn(512, 512), conv_bn(512, 512))
        self.classifier = nn.Linear(512, num_classes)

    def forward(self, x):
        x = self.layer1(self.prep(x))
        x = x + self.res1(x)
        x = self.layer3(self.layer2(x))
        x = x + self.res3(x)
        x = F.adaptive_max_pool2d(x, 1).flatten(1)
        return self.classifier(x)


def split(targets, n, alpha, seed):
    rng = np.random.default_rng(seed)
    targets = np.asarray(targets)
    res = [[] for _ in range(n)]
    for c in range(100):
        ids = rng.permutation(np.flatnonzero(targets == c))
        pr = rng.dirichlet([alpha] * n)
        for k, chunk in enumerate(np.split(ids, (np.cumsum(pr)[:-1] * len(ids)).astype(int))):
            res[k].extend(chunk.tolist())
    return res


def global_keys(model):
    """Names of state_dict entries that are averaged (everything except BN)."""
    bn_prefixes = [name + "." for name, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]
    return [k for k in model.state_dict().keys() if not any(k.startswith(b) for b in bn_prefixes)]


@torch.no_grad()
def average(model, keys, weight):
    sd = model.state_dict()
    for k in keys:
        sd[k].mul_(weight)
        dist.all_reduce(sd[k])


def train_round(model, loader, args, device):
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd,
                          nesterov=True)
    model.train()
    loss_sum, n = 0.0, 0
    for _ in range(args.local_epochs):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(y)
            n += len(y)
    return loss_sum, n


@torch.no_grad()
def local_test(model, loader, device):
    model.eval()
    c = t = 0
    for x, y in loader:
        pred = model(x.to(device, non_blocking=True)).argmax(1)
        c += (pred.cpu() == y).sum().item()
        t += len(y)
    return c / t


def main():
    args = parse()
    rank, local_rank, world = init_distributed()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True

    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    train = torchvision.datasets.CIFAR100(
        args.data, train=True,
        transform=T.Compose([T.RandomCrop(32, 4, padding_mode="reflect"), T.RandomHorizontalFlip(),
                             T.ToTensor(), T.Normalize(mean, std)]))
    test = torchvision.datasets.CIFAR100(args.data, train=False,
                                         transform=T.Compose([T.ToTensor(), T.Normalize(mean, std)]))
    parts = split(train.targets, world, args.alpha, args.seed)
    n_local = len(parts[rank])
    loader = DataLoader(Subset(train, parts[rank]), batch_size=args.bs, shuffle=True,
                        num_workers=4, pin_memory=True, drop_last=n_local > args.bs)
    test_loader = DataLoader(test, batch_size=500, num_workers=2, pin_memory=True)

    model = Res9().to(device)
    keys = global_keys(model)
    for k in keys:
        dist.broadcast(model.state_dict()[k], src=0)

    tot = torch.tensor([float(n_local)], device=device)
    dist.all_reduce(tot)
    weight = n_local / tot.item()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{world} clients; averaging {len(keys)} of {len(model.state_dict())} tensors")

    for rnd in range(1, args.rounds + 1):
        t0 = time.time()
        loss_sum, n = train_round(model, loader, args, device)
        average(model, keys, weight)
        stats = torch.tensor([loss_sum, n, 0.0], device=device)
        if rnd % args.eval_every == 0:
            stats[2] = local_test(model, test_loader, device)
        dist.all_reduce(stats)
        if rank == 0:
            msg = f"round {rnd} loss {stats[0] / stats[1]:.4f}"
            if rnd % args.eval_every == 0:
                msg += f" mean client acc {stats[2] / world:.4f}"
                torch.save(model.state_dict(), os.path.join(args.out, "global_rank0_bn.pt"))
            print(msg + f" ({time.time() - t0:.1f}s)", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
