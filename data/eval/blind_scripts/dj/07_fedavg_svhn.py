"""Federated averaging on SVHN with label-skewed (Dirichlet) clients.

Usage:
    torchrun --nproc_per_node=4 07_fedavg_svhn.py --alpha 0.5 --rounds 100
"""
import argparse
import logging
import os
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as transforms
from torch.utils.data import DataLoader, Subset
from torchvision.datasets import SVHN


def build_argparser():
    parser = argparse.ArgumentParser(description="FedAvg SVHN")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--data_path", default="/mnt/data/svhn")
    parser.add_argument("--output_dir", default="./output/fedavg_svhn")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--local_epochs", type=int, default=1)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=3407)
    parser.add_argument("--save_every", type=int, default=10)
    parser.add_argument("--num_workers", type=int, default=4)
    return parser


def setup_logger(rank, out_dir):
    logger = logging.getLogger("fl")
    logger.setLevel(logging.INFO)
    fmt = logging.Formatter("%(asctime)s | rank %(rank)s | %(message)s")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(fmt)
    logger.addHandler(handler)
    if rank == 0:
        fh = logging.FileHandler(os.path.join(out_dir, "train.log"))
        fh.setFormatter(fmt)
        logger.addHandler(fh)
    return logging.LoggerAdapter(logger, {"rank": rank})


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.n1 = nn.GroupNorm(2, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.n2 = nn.GroupNorm(2, cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                       nn.GroupNorm(2, cout))

    def forward(self, x):
        out = F.relu(self.n1(self.conv1(x)))
        out = self.n2(self.conv2(out))
        return F.relu(out + self.short(x))


class ResNet8(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.GroupNorm(2, 32), nn.ReLU())
        self.layers = nn.Sequential(BasicBlock(32, 32), BasicBlock(32, 64, 2), BasicBlock(64, 128, 2))
        self.fc = nn.Linear(128, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


def make_partition(labels, num_clients, alpha, seed):
    rng = np.random.RandomState(seed)
    client_ids = [[] for _ in range(num_clients)]
    for k in np.unique(labels):
        where = np.where(labels == k)[0]
        rng.shuffle(where)
        proportions = rng.dirichlet(np.repeat(alpha, num_clients))
        splits = (np.cumsum(proportions) * len(where)).astype(int)[:-1]
        for cid, part in enumerate(np.split(where, splits)):
            client_ids[cid] += part.tolist()
    return client_ids


def local_update(model, loader, args, device):
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    epoch_loss = []
    for _ in range(args.local_epochs):
        for images, labels in loader:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            epoch_loss.append(loss.item())
    return sum(epoch_loss) / max(len(epoch_loss), 1)


@torch.no_grad()
def aggregate(model, num_samples, device):
    ns = torch.tensor([num_samples], dtype=torch.float32, device=device)
    total = ns.clone()
    dist.all_reduce(total)
    coef = (ns / total).item()
    for param in model.parameters():
        param.mul_(coef)
        dist.all_reduce(param)
    return int(total.item())


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros((), device=device)
    count = torch.zeros((), device=device)
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        correct += (model(images).argmax(1) == labels).sum()
        count += labels.numel()
    dist.all_reduce(correct)
    dist.all_reduce(count)
    return (correct / count).item()


def main():
    args = build_argparser().parse_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    os.makedirs(args.output_dir, exist_ok=True)
    log = setup_logger(rank, args.output_dir)
    seed_all(args.seed)

    normalize = transforms.Normalize((0.4377, 0.4438, 0.4728), (0.198, 0.201, 0.197))
    train_set = SVHN(args.data_path, split="train",
                     transform=transforms.Compose([transforms.ToTensor(), normalize]))
    test_set = SVHN(args.data_path, split="test",
                    transform=transforms.Compose([transforms.ToTensor(), normalize]))

    client_ids = make_partition(np.asarray(train_set.labels), world_size, args.alpha, args.seed)
    my_ids = client_ids[rank]
    log.info("local dataset: %d images", len(my_ids))
    train_loader = DataLoader(Subset(train_set, my_ids), batch_size=args.batch_size,
                              shuffle=True, num_workers=args.num_workers, pin_memory=True)
    test_shard = Subset(test_set, range(rank, len(test_set), world_size))
    test_loader = DataLoader(test_shard, batch_size=500, num_workers=2)

    model = ResNet8().to(device)
    for t in model.state_dict().values():
        dist.broadcast(t, src=0)

    for rnd in range(1, args.rounds + 1):
        start = time.time()
        local_loss = local_update(model, train_loader, args, device)
        n_total = aggregate(model, len(my_ids), device)
        acc = evaluate(model, test_loader, device)
        if rank == 0:
            log.info("round %03d | local loss (client 0) %.4f | global test acc %.4f | %d samples | %.1fs",
                     rnd, local_loss, acc, n_total, time.time() - start)
            if rnd % args.save_every == 0 or rnd == args.rounds:
                torch.save({"round": rnd, "state_dict": model.state_dict(), "args": vars(args)},
                           os.path.join(args.output_dir, f"global_r{rnd:03d}.pt"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
