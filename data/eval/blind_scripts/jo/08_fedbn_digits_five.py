# FedBN (Li et al., ICLR'21) on Digits-Five: every domain is split into a few clients,
# BatchNorm layers stay local to each client (that is the whole point of FedBN:
# the normalisation statistics/affine params absorb the feature shift between domains),
# everything else is averaged with FedAvg weights.
#
#   torchrun --standalone --nproc_per_node=4 08_fedbn_digits_five.py --data /data/digit5 --splits 2
import argparse
import copy
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

DOMAINS = ["mnist", "mnistm", "svhn", "syn", "usps"]


class NpzDigits(Dataset):
    def __init__(self, path, idx=None, train=True):
        z = np.load(path)
        self.x, self.y = z["x"], z["y"].astype(np.int64)
        if idx is not None:
            self.x, self.y = self.x[idx], self.y[idx]
        self.train = train

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        img = torch.from_numpy(self.x[i]).permute(2, 0, 1).float().div(255.0)
        if img.shape[0] == 1:
            img = img.expand(3, -1, -1)
        img = (img - 0.5) / 0.5
        if self.train:
            dx, dy = torch.randint(-2, 3, (2,)).tolist()
            img = torch.roll(img, shifts=(dx, dy), dims=(1, 2))
        return img, self.y[i]


class DigitNet(nn.Module):
    """The FedBN digits model: conv/BN stack + MLP/BN head."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 5, 1, 2), nn.BatchNorm2d(64)
        self.conv2, self.bn2 = nn.Conv2d(64, 64, 5, 1, 2), nn.BatchNorm2d(64)
        self.conv3, self.bn3 = nn.Conv2d(64, 128, 5, 1, 2), nn.BatchNorm2d(128)
        self.fc1, self.bn4 = nn.Linear(6272, 2048), nn.BatchNorm1d(2048)
        self.fc2, self.bn5 = nn.Linear(2048, 512), nn.BatchNorm1d(512)
        self.fc3 = nn.Linear(512, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = F.relu(self.bn3(self.conv3(x))).flatten(1)
        x = F.relu(self.bn4(self.fc1(x)))
        x = F.relu(self.bn5(self.fc2(x)))
        return self.fc3(x)


def is_local_key(key):
    return ".bn" in f".{key}" or key.startswith("bn")


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/digit5")
    ap.add_argument("--out", default="runs/fedbn_digit5")
    ap.add_argument("--splits", type=int, default=2, help="clients per domain")
    ap.add_argument("--percent", type=float, default=0.1, help="fraction of each domain used")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=1)
    return ap.parse_args()


@torch.no_grad()
def eval_client(model, loader, dev):
    model.eval()
    correct = loss = n = 0.0
    for x, y in loader:
        x, y = x.to(dev), y.to(dev)
        out = model(x)
        loss += F.cross_entropy(out, y, reduction="sum").item()
        correct += (out.argmax(1) == y).sum().item()
        n += len(y)
    return correct, loss, n


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)  # shuffling / jitter differ per rank

    # client list is identical everywhere: (domain, split index, train indices)
    split_rng = np.random.default_rng(args.seed)
    clients = []
    for d in DOMAINS:
        n = len(np.load(os.path.join(args.data, f"{d}_train.npz"))["y"])
        keep = split_rng.permutation(n)[: int(n * args.percent)]
        for s, part in enumerate(np.array_split(keep, args.splits)):
            clients.append((d, s, part))
    mine = [i for i in range(len(clients)) if i % world == rank]

    base = DigitNet().to(dev)
    for t in base.state_dict().values():
        dist.broadcast(t, src=0)
    models, opts, loaders, test_loaders = {}, {}, {}, {}
    for i in mine:
        d, s, part = clients[i]
        models[i] = copy.deepcopy(base)
        opts[i] = torch.optim.SGD(models[i].parameters(), lr=args.lr)
        loaders[i] = DataLoader(NpzDigits(os.path.join(args.data, f"{d}_train.npz"), part),
                                batch_size=args.bs, shuffle=True, drop_last=True, num_workers=2)
        test_loaders[i] = DataLoader(NpzDigits(os.path.join(args.data, f"{d}_test.npz"), train=False),
                                     batch_size=256, num_workers=2)

    shared_keys = [k for k in base.state_dict() if not is_local_key(k)]
    sizes = {i: float(len(clients[i][2])) for i in range(len(clients))}
    total = sum(sizes.values())

    for rnd in range(args.rounds):
        for i in mine:
            m, opt = models[i], opts[i]
            m.train()
            for _ in range(args.local_epochs):
                for x, y in loaders[i]:
                    x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
                    opt.zero_grad()
                    F.cross_entropy(m(x), y).backward()
                    opt.step()

        # weighted sum of the shared (non-BN) weights; ranks without clients send zeros
        with torch.no_grad():
            agg = {k: torch.zeros_like(base.state_dict()[k], dtype=torch.float32) for k in shared_keys}
            for i in mine:
                sd = models[i].state_dict()
                for k in shared_keys:
                    agg[k].add_(sd[k].float(), alpha=sizes[i] / total)
            flat = torch.cat([agg[k].flatten() for k in shared_keys])
            dist.all_reduce(flat)
            off = 0
            for k in shared_keys:
                n = agg[k].numel()
                agg[k] = flat[off:off + n].view_as(agg[k])
                off += n
            for i in mine:
                models[i].load_state_dict(agg, strict=False)

        if (rnd + 1) % 5 == 0:
            # every client is evaluated on its own domain's test set with its own BN
            stats = torch.zeros(len(clients), 3, dtype=torch.float64, device=dev)
            for i in mine:
                stats[i] = torch.tensor(eval_client(models[i], test_loaders[i], dev), dtype=torch.float64, device=dev)
            dist.all_reduce(stats)
            if rank == 0:
                per_dom = {}
                for i, (d, s, _) in enumerate(clients):
                    per_dom.setdefault(d, []).append((stats[i, 0] / stats[i, 2]).item())
                line = " ".join(f"{d}:{np.mean(v):.3f}" for d, v in per_dom.items())
                print(f"round {rnd + 1:3d} | {line} | avg {np.mean([np.mean(v) for v in per_dom.values()]):.3f}",
                      flush=True)

    os.makedirs(args.out, exist_ok=True)
    if rank == 0:
        torch.save({k: v for k, v in models[mine[0]].state_dict().items() if not is_local_key(k)},
                   os.path.join(args.out, "shared.pt"))
    for i in mine:
        d, s, _ = clients[i]
        bn = {k: v for k, v in models[i].state_dict().items() if is_local_key(k)}
        torch.save(bn, os.path.join(args.out, f"bn_{d}_{s}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
