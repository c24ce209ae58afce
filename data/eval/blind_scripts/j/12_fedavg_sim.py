"""FedAvg simulation: 100 non-IID clients (Dirichlet alpha) simulated on N GPUs.

Each process hosts a subset of the sampled clients every round, trains them locally and the
server model is the sample-weighted average, computed with all_reduce.

    python 12_fedavg_sim.py --gpus 4 --rounds 500 --clients_per_round 20 --alpha 0.3
"""
import os
import copy
import time
import random
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader, Subset


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument('--gpus', type=int, default=4)
    p.add_argument('--data', default='./data')
    p.add_argument('--num_clients', type=int, default=100)
    p.add_argument('--clients_per_round', type=int, default=20)
    p.add_argument('--rounds', type=int, default=500)
    p.add_argument('--local_epochs', type=int, default=2)
    p.add_argument('--local_bs', type=int, default=32)
    p.add_argument('--lr', type=float, default=0.01)
    p.add_argument('--alpha', type=float, default=0.3)
    p.add_argument('--eval_every', type=int, default=10)
    p.add_argument('--seed', type=int, default=42)
    p.add_argument('--port', type=int, default=29533)
    p.add_argument('--out', default='fedavg_out')
    return p.parse_args()


class CNN(nn.Module):
    # the "CNN" of McMahan et al. for CIFAR-10 (no batchnorm, FedAvg friendly)
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=2)
        self.fc1 = nn.Linear(64 * 8 * 8, 512)
        self.fc2 = nn.Linear(512, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def dirichlet_split(labels, n_clients, alpha, seed):
    rng = np.random.RandomState(seed)
    labels = np.asarray(labels)
    idx = [[] for _ in range(n_clients)]
    for c in range(labels.max() + 1):
        ids = np.where(labels == c)[0]
        rng.shuffle(ids)
        props = rng.dirichlet([alpha] * n_clients)
        cuts = (np.cumsum(props) * len(ids)).astype(int)[:-1]
        for k, part in enumerate(np.split(ids, cuts)):
            idx[k].extend(part.tolist())
    return idx


def local_train(model, loader, epochs, lr, device):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    for _ in range(epochs):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return model


@torch.no_grad()
def test(model, loader, device):
    model.eval()
    correct = total = 0
    for x, y in loader:
        pred = model(x.to(device)).argmax(1).cpu()
        correct += (pred == y).sum().item()
        total += y.numel()
    return correct / total


def worker(rank, world, args):
    os.environ.setdefault('MASTER_ADDR', '127.0.0.1')
    os.environ['MASTER_PORT'] = str(args.port)
    torch.cuda.set_device(rank)
    device = torch.device('cuda', rank)
    dist.init_process_group('nccl', rank=rank, world_size=world, device_id=device)

    norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261))
    train_set = torchvision.datasets.CIFAR10(args.data, train=True,
                                             transform=T.Compose([T.RandomCrop(32, 4), T.RandomHorizontalFlip(),
                                                                  T.ToTensor(), norm]))
    client_idx = dirichlet_split(train_set.targets, args.num_clients, args.alpha, args.seed)

    torch.manual_seed(args.seed)
    global_model = CNN().to(device)
    # every rank starts from rank 0's weights, whatever the local RNG did
    for p in global_model.parameters():
        dist.broadcast(p.data, src=0)

    test_loader = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        test_set = torchvision.datasets.CIFAR10(args.data, train=False, transform=T.Compose([T.ToTensor(), norm]))
        test_loader = DataLoader(test_set, batch_size=1000, num_workers=4)
        log = open(os.path.join(args.out, 'log.csv'), 'w')
        log.write('round,acc,secs\n')

    rng = random.Random(args.seed)
    for rnd in range(1, args.rounds + 1):
        t0 = time.time()
        # server side client sampling on rank 0, shared with everyone
        sel = [rng.sample(range(args.num_clients), args.clients_per_round) if rank == 0 else None]
        dist.broadcast_object_list(sel, src=0)
        my_clients = sel[0][rank::world]

        agg = [torch.zeros_like(p) for p in global_model.parameters()]
        n_samples = torch.zeros((), device=device)
        for cid in my_clients:
            if len(client_idx[cid]) == 0:
                continue
            local = copy.deepcopy(global_model)
            loader = DataLoader(Subset(train_set, client_idx[cid]), batch_size=args.local_bs, shuffle=True,
                                num_workers=2, drop_last=False)
            local_train(local, loader, args.local_epochs, args.lr, device)
            n = float(len(client_idx[cid]))
            for a, p in zip(agg, local.parameters()):
                a.add_(p.data, alpha=n)
            n_samples += n

        # every rank reaches these, including a rank that got no client this round
        for a in agg:
            dist.all_reduce(a)
        dist.all_reduce(n_samples)
        with torch.no_grad():
            for p, a in zip(global_model.parameters(), agg):
                p.copy_(a / n_samples)

        stats = {'rank': rank, 'clients': len(my_clients), 'secs': time.time() - t0}
        gathered = [None] * world
        dist.all_gather_object(gathered, stats)

        if rank == 0 and rnd % args.eval_every == 0:
            acc = test(global_model, test_loader, device)
            slowest = max(g['secs'] for g in gathered)
            print(f'round {rnd:4d} acc {acc:.4f} slowest worker {slowest:.1f}s', flush=True)
            log.write(f'{rnd},{acc:.4f},{slowest:.2f}\n')
            log.flush()
            torch.save(global_model.state_dict(), os.path.join(args.out, 'global.pt'))

    if rank == 0:
        log.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == '__main__':
    args = get_args()
    if not os.path.isdir(os.path.join(args.data, 'cifar-10-batches-py')):
        torchvision.datasets.CIFAR10(args.data, train=True, download=True)
        torchvision.datasets.CIFAR10(args.data, train=False, download=True)
    world = min(args.gpus, torch.cuda.device_count())
    mp.spawn(worker, args=(world, args), nprocs=world, join=True)
