"""FedProx on CIFAR-10 with straggler simulation.

A fraction of the selected clients is marked as stragglers each round and only
performs a random number of local epochs (1..E), as in Li et al. (MLSys 2020).
Multiple simulated clients run on every GPU process.

    torchrun --nproc_per_node=4 --master_port=29533 12_fedprox_cifar10.py --mu 0.01 --stragglers 0.5
"""
import argparse
import logging
import os
import random
from copy import deepcopy

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--data_dir", type=str, default="/data/cifar10")
    p.add_argument("--log_dir", type=str, default="tb/fedprox_cifar10")
    p.add_argument("--num_clients", type=int, default=50)
    p.add_argument("--clients_per_round", type=int, default=10)
    p.add_argument("--rounds", type=int, default=400)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--mu", type=float, default=0.01)
    p.add_argument("--stragglers", type=float, default=0.5)
    p.add_argument("--beta", type=float, default=0.5, help="Dirichlet alpha for label skew")
    p.add_argument("--seed", type=int, default=2024)
    return p.parse_args()


class VGG9(nn.Module):
    cfg = [32, "M", 64, "M", 128, 128, "M", 256, 256, "M"]

    def __init__(self, num_classes=10):
        super().__init__()
        layers, c_in = [], 3
        for v in self.cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(c_in, v, 3, padding=1), nn.ReLU(inplace=True)]
                c_in = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Dropout(0.3), nn.Linear(256 * 2 * 2, 512), nn.ReLU(inplace=True),
            nn.Linear(512, 512), nn.ReLU(inplace=True), nn.Linear(512, num_classes),
        )

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


def label_skew(targets, n_clients, beta, seed):
    rng = np.random.default_rng(seed)
    targets = np.array(targets)
    idx_per_client = [[] for _ in range(n_clients)]
    for c in range(10):
        idx = rng.permutation(np.where(targets == c)[0])
        props = rng.dirichlet(np.full(n_clients, beta))
        splits = (np.cumsum(props) * len(idx)).astype(int)[:-1]
        for k, chunk in enumerate(np.split(idx, splits)):
            idx_per_client[k].extend(chunk.tolist())
    return idx_per_client


class Client:
    def __init__(self, cid, dataset, indices, args, device):
        self.cid = cid
        self.n = len(indices)
        self.loader = DataLoader(Subset(dataset, indices), batch_size=args.batch_size, shuffle=True,
                                 num_workers=2, pin_memory=True)
        self.args = args
        self.device = device

    def train(self, model, global_params, epochs):
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=self.args.lr, weight_decay=1e-4)
        for _ in range(epochs):
            for x, y in self.loader:
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                loss = F.cross_entropy(model(x), y)
                if self.args.mu > 0:
                    prox = 0.0
                    for w, w0 in zip(model.parameters(), global_params):
                        prox = prox + (w - w0).pow(2).sum()
                    loss = loss + self.args.mu / 2 * prox
                opt.zero_grad()
                loss.backward()
                opt.step()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group("nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = logging.getLogger(f"rank{rank}")
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    norm = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010))
    train_set = datasets.CIFAR10(args.data_dir, train=True, transform=transforms.Compose(
        [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    test_set = datasets.CIFAR10(args.data_dir, train=False,
                                transform=transforms.Compose([transforms.ToTensor(), norm]))
    parts = label_skew(train_set.targets, args.num_clients, args.beta, args.seed)

    # build only the clients this rank simulates
    clients = {c: Client(c, train_set, parts[c], args, device)
               for c in range(args.num_clients) if c % world == rank and len(parts[c]) > 0}
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=512,
                             num_workers=4)

    server_model = VGG9().to(device)
    for t in server_model.state_dict().values():
        dist.broadcast(t, 0)
    worker = deepcopy(server_model)
    writer = SummaryWriter(args.log_dir) if rank == 0 else None

    for rnd in range(args.rounds):
        rng = np.random.default_rng(args.seed + 31 * rnd)
        selected = rng.choice(args.num_clients, args.clients_per_round, replace=False)
        n_slow = int(args.stragglers * len(selected))
        slow = set(selected[:n_slow].tolist())
        slow_epochs = {int(c): int(rng.integers(1, args.epochs + 1)) for c in selected[:n_slow]}

        global_params = [p.detach().clone() for p in server_model.parameters()]
        acc = [torch.zeros_like(p) for p in server_model.parameters()]
        weight = torch.zeros(1, device=device)
        for cid in selected:
            cid = int(cid)
            if cid not in clients:
                continue
            worker.load_state_dict(server_model.state_dict())
            ep = slow_epochs[cid] if cid in slow else args.epochs
            clients[cid].train(worker, global_params, ep)
            for a, p in zip(acc, worker.parameters()):
                a.add_(p.detach(), alpha=clients[cid].n)
            weight += clients[cid].n

        dist.all_reduce(weight)
        for a in acc:
            dist.all_reduce(a)
        with torch.no_grad():
            for p, a in zip(server_model.parameters(), acc):
                p.copy_(a / weight)

        if (rnd + 1) % 10 == 0:
            server_model.eval()
            res = torch.zeros(2, device=device)
            with torch.no_grad():
                for x, y in test_loader:
                    x, y = x.to(device), y.to(device)
                    res[0] += (server_model(x).argmax(1) == y).sum()
                    res[1] += len(y)
            dist.all_reduce(res)
            test_acc = (res[0] / res[1]).item()
            if rank == 0:
                log.info("round %d test acc %.4f", rnd + 1, test_acc)
                writer.add_scalar("test/acc", test_acc, rnd + 1)
                torch.save(server_model.state_dict(), os.path.join(args.log_dir, "server_model.pt"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
