"""FedAvg simulation on EMNIST (balanced) with a Dirichlet non-IID split.

One simulated client per GPU process.  Each communication round every client
runs a few local epochs on its own shard, then the server update is an
all-reduce of the sample-weighted parameters.

    torchrun --nproc_per_node=8 fedavg_dirichlet_emnist.py --alpha 0.3 --rounds 200
"""
import argparse
import copy
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/shared/datasets")
    p.add_argument("--log-dir", default="fed_logs")
    p.add_argument("--alpha", type=float, default=0.3, help="Dirichlet concentration")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--client-lr", type=float, default=0.02)
    p.add_argument("--server-lr", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args()


class CNN(nn.Module):
    def __init__(self, num_classes=47):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=2)
        self.fc1 = nn.Linear(64 * 7 * 7, 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def dirichlet_split(labels, n_clients, alpha, seed):
    """Same seed on every process -> identical partition everywhere."""
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    parts = [[] for _ in range(n_clients)]
    for c in np.unique(labels):
        idx = np.where(labels == c)[0]
        rng.shuffle(idx)
        props = rng.dirichlet(alpha * np.ones(n_clients))
        cuts = (np.cumsum(props) * len(idx)).astype(int)[:-1]
        for k, chunk in enumerate(np.split(idx, cuts)):
            parts[k].extend(chunk.tolist())
    return parts


def local_train(model, loader, epochs, lr, device):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0)
    model.train()
    last = 0.0
    for _ in range(epochs):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            last = loss.item()
    return last


@torch.no_grad()
def fedavg(global_model, local_model, n_local, server_lr):
    """Weighted average of client models, applied as a server step."""
    weight = torch.tensor([float(n_local)])
    dist.all_reduce(weight)
    frac = n_local / weight.item()
    for g, l in zip(global_model.parameters(), local_model.parameters()):
        delta = (l.data - g.data) * frac
        dist.all_reduce(delta)
        g.data.add_(delta, alpha=server_lr)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total, loss = 0, 0, 0.0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss += F.cross_entropy(out, y, reduction="sum").item()
        correct += (out.argmax(1) == y).sum().item()
        total += y.numel()
    return correct / total, loss / total


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1751,), (0.3332,))])
    train = datasets.EMNIST(args.data, split="balanced", train=True, transform=tf)
    test = datasets.EMNIST(args.data, split="balanced", train=False, transform=tf)

    parts = dirichlet_split(train.targets.numpy(), world, args.alpha, args.seed)
    my_idx = parts[rank]
    client_loader = DataLoader(Subset(train, my_idx), batch_size=args.batch_size,
                               shuffle=True, num_workers=2, drop_last=False)
    print(f"client {rank}: {len(my_idx)} samples, "
          f"{len(np.unique(train.targets.numpy()[my_idx]))} classes", flush=True)

    torch.manual_seed(args.seed)
    global_model = CNN().to(device)
    # start every client from rank 0's initialisation
    for p in global_model.parameters():
        dist.broadcast(p.data, src=0)

    history = []
    if rank == 0:
        os.makedirs(args.log_dir, exist_ok=True)
        test_loader = DataLoader(test, batch_size=1024, num_workers=4)

    for rnd in range(1, args.rounds + 1):
        t0 = time.time()
        local_model = copy.deepcopy(global_model)
        loss = local_train(local_model, client_loader, args.local_epochs,
                           args.client_lr, device)
        fedavg(global_model, local_model, len(my_idx), args.server_lr)

        loss_t = torch.tensor([loss], device=device)
        dist.all_reduce(loss_t)
        if rank == 0 and rnd % args.eval_every == 0:
            acc, tloss = evaluate(global_model, test_loader, device)
            rec = {"round": rnd, "train_loss": loss_t.item() / world,
                   "test_acc": acc, "test_loss": tloss, "sec": time.time() - t0}
            history.append(rec)
            print(json.dumps(rec), flush=True)
            torch.save({"round": rnd, "model": global_model.state_dict()},
                       os.path.join(args.log_dir, "global_latest.pt"))
        dist.barrier()

    if rank == 0:
        with open(os.path.join(args.log_dir, "history.json"), "w") as f:
            json.dump(history, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
