"""FedAvg with many virtual clients per GPU, partition cache and early stopping.

--num_clients virtual clients are assigned round-robin to the ranks. Each round
the same --per_round clients are drawn on every rank; a rank trains the drawn
clients it owns one after another and accumulates n_i * w_i. Ranks that own no
drawn client this round contribute zeros, so every rank always issues the same
collectives.

    torchrun --standalone --nproc_per_node=4 10_fedavg_virtual_clients_earlystop.py \
        --num_clients 200 --per_round 20 --alpha 0.2
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, transforms


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--workdir", default="./work/emnist_letters")
    p.add_argument("--num_clients", type=int, default=200)
    p.add_argument("--per_round", type=int, default=20)
    p.add_argument("--rounds", type=int, default=1000)
    p.add_argument("--local_epochs", type=int, default=1)
    p.add_argument("--batch_size", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--alpha", type=float, default=0.2)
    p.add_argument("--patience", type=int, default=15, help="evaluations without improvement")
    p.add_argument("--eval_every", type=int, default=5)
    p.add_argument("--seed", type=int, default=11)
    return p.parse_args()


class SmallCNN(nn.Module):
    def __init__(self, classes=26):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2))
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(64 * 7 * 7, 512), nn.ReLU(),
                                nn.Linear(512, classes))

    def forward(self, x):
        return self.fc(self.conv(x))


def compute_partition(targets, n_clients, alpha, seed):
    rng = np.random.default_rng(seed)
    out = [[] for _ in range(n_clients)]
    for c in np.unique(targets):
        ids = rng.permutation(np.flatnonzero(targets == c))
        q = rng.dirichlet(np.full(n_clients, alpha))
        for k, part in enumerate(np.split(ids, (np.cumsum(q)[:-1] * len(ids)).astype(int))):
            out[k].extend(int(i) for i in part)
    return out


def load_or_create_partition(path, targets, args, rank):
    if rank == 0 and not os.path.exists(path):
        parts = compute_partition(targets, args.num_clients, args.alpha, args.seed)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(parts, f)
        os.replace(tmp, path)
    dist.barrier()
    with open(path) as f:
        return json.load(f)


def train_client(model, loader, args, device):
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    model.train()
    for _ in range(args.local_epochs):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = total = 0
    for x, y in loader:
        correct += (model(x.to(device)).argmax(1).cpu() == y).sum().item()
        total += y.numel()
    return correct / total


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)

    if rank == 0:
        os.makedirs(args.workdir, exist_ok=True)
        datasets.EMNIST(args.data, split="letters", train=True, download=True)
        datasets.EMNIST(args.data, split="letters", train=False, download=True)
    dist.barrier()

    # EMNIST "letters" labels are 1..26
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1722,), (0.3309,))])
    shift = lambda t: t - 1  # noqa: E731
    train = datasets.EMNIST(args.data, split="letters", train=True, transform=tf, target_transform=shift)
    test = datasets.EMNIST(args.data, split="letters", train=False, transform=tf, target_transform=shift)

    part_file = os.path.join(args.workdir, f"partition_n{args.num_clients}_a{args.alpha}_s{args.seed}.json")
    parts = load_or_create_partition(part_file, train.targets.numpy(), args, rank)
    sizes = np.array([len(p) for p in parts])
    owned = {cid for cid in range(args.num_clients) if cid % world == rank}
    loaders = {cid: DataLoader(Subset(train, parts[cid]), batch_size=args.batch_size, shuffle=True)
               for cid in owned if sizes[cid] > 0}

    model = SmallCNN().to(device)
    global_vec = parameters_to_vector(model.parameters()).detach().clone()
    dist.broadcast(global_vec, src=0)
    test_loader = DataLoader(test, batch_size=1000, num_workers=4) if rank == 0 else None

    best_acc, bad_evals, log = 0.0, 0, []
    for rnd in range(1, args.rounds + 1):
        t0 = time.time()
        rng = np.random.default_rng([args.seed, rnd])
        eligible = np.flatnonzero(sizes > 0)
        drawn = rng.choice(eligible, size=args.per_round, replace=False)

        acc_vec = torch.zeros_like(global_vec)
        acc_n = torch.zeros(1, device=device)
        for cid in drawn:
            if int(cid) not in owned:
                continue
            vector_to_parameters(global_vec, model.parameters())
            train_client(model, loaders[int(cid)], args, device)
            n_i = float(sizes[cid])
            acc_vec.add_(parameters_to_vector(model.parameters()).detach(), alpha=n_i)
            acc_n += n_i

        dist.all_reduce(acc_vec)
        dist.all_reduce(acc_n)
        global_vec = acc_vec / acc_n
        vector_to_parameters(global_vec, model.parameters())

        stop = torch.zeros(1, device=device)
        if rnd % args.eval_every == 0:
            if rank == 0:
                acc = evaluate(model, test_loader, device)
                log.append({"round": rnd, "acc": acc, "sec": time.time() - t0})
                print(json.dumps(log[-1]), flush=True)
                if acc > best_acc:
                    best_acc, bad_evals = acc, 0
                    torch.save(model.state_dict(), os.path.join(args.workdir, "best.pt"))
                else:
                    bad_evals += 1
                stop.fill_(float(bad_evals >= args.patience))
            dist.broadcast(stop, src=0)
        if stop.item() > 0:
            if rank == 0:
                print(f"early stop at round {rnd}, best acc {best_acc:.4f}")
            break

    if rank == 0:
        with open(os.path.join(args.workdir, "log.json"), "w") as f:
            json.dump(log, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
