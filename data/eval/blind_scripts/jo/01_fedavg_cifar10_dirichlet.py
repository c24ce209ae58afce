"""FedAvg on CIFAR-10 with a Dirichlet non-IID split, simulated on a GPU cluster.

Each torchrun process hosts a slice of the sampled clients for every round.
Local updates are averaged with a weighted all-reduce (weights = client sizes).

    torchrun --nproc_per_node=8 01_fedavg_cifar10_dirichlet.py --num-clients 100 --clients-per-round 16
"""
import argparse
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, transforms

log = logging.getLogger("fedavg")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default="/datasets/cifar10")
    p.add_argument("--out-dir", default="runs/fedavg_cifar10")
    p.add_argument("--num-clients", type=int, default=100)
    p.add_argument("--clients-per-round", type=int, default=16)
    p.add_argument("--rounds", type=int, default=500)
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--alpha", type=float, default=0.3, help="Dirichlet concentration")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--workers", type=int, default=2)
    return p.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class CNN(nn.Module):
    """The 2-conv CNN from McMahan et al. with a slightly wider classifier."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=2)
        self.fc1 = nn.Linear(64 * 8 * 8, 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


def dirichlet_partition(labels, num_clients, alpha, min_size=10):
    """Split sample indices over clients with per-class Dirichlet proportions."""
    labels = np.asarray(labels)
    num_classes = labels.max() + 1
    while True:
        client_idx = [[] for _ in range(num_clients)]
        for c in range(num_classes):
            idx_c = np.where(labels == c)[0]
            np.random.shuffle(idx_c)
            props = np.random.dirichlet(np.repeat(alpha, num_clients))
            cuts = (np.cumsum(props) * len(idx_c)).astype(int)[:-1]
            for k, part in enumerate(np.split(idx_c, cuts)):
                client_idx[k].extend(part.tolist())
        if min(len(ci) for ci in client_idx) >= min_size:
            return client_idx


def local_train(model, loader, epochs, lr, device):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    running, seen = 0.0, 0
    for _ in range(epochs):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            running += loss.item() * x.size(0)
            seen += x.size(0)
    return running / max(seen, 1)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss sum, correct, count
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = model(x)
        stats[0] += F.cross_entropy(out, y, reduction="sum")
        stats[1] += (out.argmax(1) == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [r{rank}] %(message)s",
    )
    set_seed(args.seed + rank)

    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    train_tf = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])

    if rank == 0:
        datasets.CIFAR10(args.data_root, train=True, download=True)
        datasets.CIFAR10(args.data_root, train=False, download=True)
    dist.barrier()
    train_set = datasets.CIFAR10(args.data_root, train=True, transform=train_tf)
    test_set = datasets.CIFAR10(args.data_root, train=False, transform=test_tf)

    client_idx = dirichlet_partition(train_set.targets, args.num_clients, args.alpha)
    sizes = [len(ci) for ci in client_idx]
    log.info("client sizes: min %d / median %d / max %d", min(sizes), int(np.median(sizes)), max(sizes))

    # every rank evaluates a strided slice of the test set
    test_shard = Subset(test_set, list(range(rank, len(test_set), world)))
    test_loader = DataLoader(test_shard, batch_size=256, num_workers=args.workers, pin_memory=True)

    global_model = CNN().to(device)
    for p in global_model.parameters():
        dist.broadcast(p.data, src=0)
    client_model = CNN().to(device)

    os.makedirs(args.out_dir, exist_ok=True)
    best_acc = 0.0
    for rnd in range(1, args.rounds + 1):
        t0 = time.time()
        round_rng = np.random.default_rng(args.seed * 100003 + rnd)
        sampled = round_rng.choice(args.num_clients, args.clients_per_round, replace=False)
        my_clients = sampled[rank::world]

        acc_state = {k: torch.zeros_like(v, dtype=torch.float32)
                     for k, v in global_model.state_dict().items()}
        weight = torch.zeros(1, device=device)
        loss_sum = torch.zeros(1, device=device)

        for cid in my_clients:
            client_model.load_state_dict(global_model.state_dict())
            loader = DataLoader(
                Subset(train_set, client_idx[cid]),
                batch_size=args.batch_size,
                shuffle=True,
                num_workers=args.workers,
                pin_memory=True,
            )
            n_k = float(len(client_idx[cid]))
            loss = local_train(client_model, loader, args.local_epochs, args.lr, device)
            for k, v in client_model.state_dict().items():
                acc_state[k] += v.float() * n_k
            weight += n_k
            loss_sum += loss * n_k

        for t in acc_state.values():
            dist.all_reduce(t)
        dist.all_reduce(weight)
        dist.all_reduce(loss_sum)

        new_state = {k: (acc_state[k] / weight).to(v.dtype)
                     for k, v in global_model.state_dict().items()}
        global_model.load_state_dict(new_state)

        log.info("round %d  train_loss %.4f  (%.1fs)", rnd, (loss_sum / weight).item(), time.time() - t0)

        if rnd % args.eval_every == 0 or rnd == args.rounds:
            test_loss, test_acc = evaluate(global_model, test_loader, device)
            log.info("round %d  test_loss %.4f  test_acc %.4f", rnd, test_loss, test_acc)
            if rank == 0:
                ckpt = {"round": rnd, "model": global_model.state_dict(), "args": vars(args)}
                torch.save(ckpt, os.path.join(args.out_dir, "last.pt"))
                if test_acc > best_acc:
                    best_acc = test_acc
                    torch.save(ckpt, os.path.join(args.out_dir, "best.pt"))

    log.info("done, best test acc %.4f", best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
