"""
FedAvg on LEAF FEMNIST (natural per-writer split), one process per GPU via mp.spawn.

Writers (clients) are read from the LEAF json files, sampled each round and
distributed round-robin over the worker processes. Aggregation is a weighted
all-reduce of the model deltas.

usage:  python 03_fedavg_femnist_mp.py --leaf-dir /data/leaf/femnist/data --gpus 4
"""
import argparse
import glob
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class FemnistCNN(nn.Module):
    def __init__(self, n_classes=62):
        super().__init__()
        self.c1 = nn.Conv2d(1, 32, 5, padding=2)
        self.c2 = nn.Conv2d(32, 64, 5, padding=2)
        self.fc = nn.Linear(7 * 7 * 64, 2048)
        self.out = nn.Linear(2048, n_classes)

    def forward(self, x):
        x = x.view(-1, 1, 28, 28)
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.out(F.relu(self.fc(x.flatten(1))))


def load_leaf(split_dir):
    users, data = [], {}
    for fn in sorted(glob.glob(os.path.join(split_dir, "*.json"))):
        with open(fn) as f:
            blob = json.load(f)
        users.extend(blob["users"])
        data.update(blob["user_data"])
    return users, data


def to_dataset(user_blob):
    x = torch.tensor(np.asarray(user_blob["x"], dtype=np.float32))
    y = torch.tensor(np.asarray(user_blob["y"], dtype=np.int64))
    return TensorDataset(x, y)


def train_client(model, ds, epochs, bs, lr, device):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loader = DataLoader(ds, batch_size=bs, shuffle=True)
    tot, n = 0.0, 0
    for _ in range(epochs):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot += loss.item() * len(y)
            n += len(y)
    return tot / max(n, 1)


@torch.no_grad()
def test_clients(model, users, data, device):
    model.eval()
    correct = torch.zeros((), device=device)
    count = torch.zeros((), device=device)
    for u in users:
        ds = to_dataset(data[u])
        for x, y in DataLoader(ds, batch_size=512):
            x, y = x.to(device), y.to(device)
            correct += (model(x).argmax(1) == y).sum()
            count += len(y)
    return correct, count


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    train_users, train_data = load_leaf(os.path.join(args.leaf_dir, "train"))
    test_users, test_data = load_leaf(os.path.join(args.leaf_dir, "test"))
    if rank == 0:
        print(f"{len(train_users)} writers, {sum(len(train_data[u]['y']) for u in train_users)} samples")

    model = FemnistCNN().to(device)
    client = FemnistCNN().to(device)
    for p in model.parameters():
        dist.broadcast(p.data, 0)

    history = []
    for rnd in range(args.rounds):
        t0 = time.time()
        rng = np.random.RandomState(args.seed + rnd)
        picked = rng.choice(len(train_users), args.per_round, replace=False)
        mine = [train_users[i] for i in picked[rank::world_size]]

        delta = [torch.zeros_like(p) for p in model.parameters()]
        w = torch.zeros(1, device=device)
        for u in mine:
            client.load_state_dict(model.state_dict())
            ds = to_dataset(train_data[u])
            train_client(client, ds, args.local_epochs, args.batch_size, args.lr, device)
            n = len(ds)
            for d, pc, pg in zip(delta, client.parameters(), model.parameters()):
                d += (pc.detach() - pg.detach()) * n
            w += n

        dist.all_reduce(w)
        for d in delta:
            dist.all_reduce(d)
        with torch.no_grad():
            for p, d in zip(model.parameters(), delta):
                p += args.server_lr * d / w

        if (rnd + 1) % args.eval_every == 0:
            users = test_users[rank::world_size]
            correct, count = test_clients(model, users, test_data, device)
            dist.all_reduce(correct)
            dist.all_reduce(count)
            acc = (correct / count).item()
            history.append({"round": rnd + 1, "acc": acc, "time": time.time() - t0})
            if rank == 0:
                print(f"round {rnd + 1:4d} | test acc {acc:.4f} | {time.time() - t0:.1f}s", flush=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(args.out, "femnist_fedavg.pt"))
        with open(os.path.join(args.out, "history.json"), "w") as f:
            json.dump(history, f)
    dist.barrier()
    dist.destroy_process_group()


parser = argparse.ArgumentParser()
parser.add_argument("--leaf-dir", default="/data/leaf/femnist/data")
parser.add_argument("--out", default="./out/femnist")
parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
parser.add_argument("--rounds", type=int, default=2000)
parser.add_argument("--per-round", type=int, default=10)
parser.add_argument("--local-epochs", type=int, default=1)
parser.add_argument("--batch-size", type=int, default=10)
parser.add_argument("--lr", type=float, default=0.004)
parser.add_argument("--server-lr", type=float, default=1.0)
parser.add_argument("--eval-every", type=int, default=50)
parser.add_argument("--seed", type=int, default=7)
args = parser.parse_args()

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29511")

mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
