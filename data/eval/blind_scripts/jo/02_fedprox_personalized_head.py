# FedProx + personalised classifier heads (FedPer style) on CIFAR-10 shards.
#
# Clients are pinned to ranks (client c lives on rank c % world_size) so that the
# personal head of a client always stays in the memory of the same process.
# Only the shared body is aggregated; heads never leave their rank.
#
#   torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d \
#       --rdzv_endpoint=$MASTER:29400 02_fedprox_personalized_head.py --mu 0.01
import argparse
import glob
import json
import os
from collections import OrderedDict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, transforms


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/shared/datasets/cifar10")
    ap.add_argument("--ckpt-dir", default="/shared/ckpt/fedper_prox")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--shards-per-client", type=int, default=2)
    ap.add_argument("--frac", type=float, default=0.25)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--local-steps", type=int, default=50)
    ap.add_argument("--bs", type=int, default=50)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--mu", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.GroupNorm(8, 128), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(128, 256, 3, padding=1), nn.GroupNorm(8, 256), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.proj = nn.Linear(256, 128)

    def forward(self, x):
        return F.relu(self.proj(self.features(x).flatten(1)))


class Net(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.body = Body()
        self.head = nn.Linear(128, num_classes)

    def forward(self, x):
        return self.head(self.body(x))


def shard_partition(targets, clients, shards_per_client, seed):
    rng = np.random.default_rng(seed)
    order = np.argsort(np.asarray(targets), kind="stable")
    n_shards = clients * shards_per_client
    shards = np.array_split(order, n_shards)
    perm = rng.permutation(n_shards)
    return [np.concatenate([shards[s] for s in perm[c::clients]]).tolist() for c in range(clients)]


def infinite(loader):
    while True:
        for batch in loader:
            yield batch


def local_update(model, global_body, loader, steps, lr, mu, device):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    anchor = [p.detach().clone() for p in global_body.parameters()]
    it = infinite(loader)
    for _ in range(steps):
        x, y = next(it)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(model(x), y)
        prox = sum(((p - a) ** 2).sum() for p, a in zip(model.body.parameters(), anchor))
        loss = loss + 0.5 * mu * prox
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return loss.item()


@torch.no_grad()
def personal_accuracy(model, loader, device):
    model.eval()
    correct = total = 0
    for x, y in loader:
        pred = model(x.to(device)).argmax(1)
        correct += (pred == y.to(device)).sum().item()
        total += y.numel()
    return correct, total


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed + rank)  # local shuffling / augmentation only

    tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize((0.5,) * 3, (0.5,) * 3)])
    tf_test = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.5,) * 3)])
    train = datasets.CIFAR10(args.data, train=True, transform=tf)
    test = datasets.CIFAR10(args.data, train=False, transform=tf_test)

    parts = shard_partition(train.targets, args.clients, args.shards_per_client, args.seed)
    my_clients = list(range(rank, args.clients, world))
    # personal test split: test images of the classes the client has seen
    test_targets = np.asarray(test.targets)
    train_targets = np.asarray(train.targets)
    test_parts = {}
    for c in my_clients:
        seen = np.unique(train_targets[parts[c]])
        test_parts[c] = np.where(np.isin(test_targets, seen))[0].tolist()

    model = Net().to(dev)
    global_body = Body().to(dev)
    for t in global_body.state_dict().values():
        dist.broadcast(t, src=0)
    heads = {c: OrderedDict((k, v.clone()) for k, v in model.head.state_dict().items()) for c in my_clients}

    start_round = 0
    if args.resume and os.path.exists(os.path.join(args.ckpt_dir, "global.pt")):
        g = torch.load(os.path.join(args.ckpt_dir, "global.pt"), map_location=dev)
        global_body.load_state_dict(g["body"])
        start_round = g["round"]
        # heads were written per rank; pick ours up whatever the previous world size was
        for fn in sorted(glob.glob(os.path.join(args.ckpt_dir, "heads_rank*.pt")), key=os.path.getmtime):
            h = torch.load(fn, map_location="cpu")
            heads.update({int(c): sd for c, sd in h.items() if int(c) in heads})

    m = max(1, int(args.frac * args.clients))
    for rnd in range(start_round, args.rounds):
        rng = np.random.default_rng([args.seed, rnd])
        sampled = set(rng.choice(args.clients, m, replace=False).tolist())
        active = [c for c in my_clients if c in sampled]

        acc = [torch.zeros_like(p, dtype=torch.float32) for p in global_body.parameters()]
        wsum = torch.zeros((), device=dev)
        # a rank may have no sampled client this round; it still joins the reduce with zeros
        for c in active:
            model.body.load_state_dict(global_body.state_dict())
            model.head.load_state_dict(heads[c])
            loader = DataLoader(Subset(train, parts[c]), batch_size=args.bs, shuffle=True,
                                num_workers=2, drop_last=True, persistent_workers=False)
            local_update(model, global_body, loader, args.local_steps, args.lr, args.mu, dev)
            n = float(len(parts[c]))
            for a, p in zip(acc, model.body.parameters()):
                a.add_(p.detach().float(), alpha=n)
            wsum += n
            heads[c] = OrderedDict((k, v.detach().cpu().clone()) for k, v in model.head.state_dict().items())

        flat = torch.cat([a.flatten() for a in acc] + [wsum.view(1)])
        dist.all_reduce(flat)
        total = flat[-1]
        with torch.no_grad():
            off = 0
            for p in global_body.parameters():
                k = p.numel()
                p.copy_((flat[off:off + k] / total).view_as(p))
                off += k

        if (rnd + 1) % 20 == 0 or rnd + 1 == args.rounds:
            stats = torch.zeros(2, device=dev, dtype=torch.float64)
            for c in my_clients:
                model.body.load_state_dict(global_body.state_dict())
                model.head.load_state_dict(heads[c])
                tl = DataLoader(Subset(test, test_parts[c]), batch_size=500, num_workers=2)
                cor, tot = personal_accuracy(model, tl, dev)
                stats[0] += cor
                stats[1] += tot
            dist.all_reduce(stats)
            if rank == 0:
                print(json.dumps({"round": rnd + 1, "personal_acc": (stats[0] / stats[1]).item()}), flush=True)

            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({str(c): sd for c, sd in heads.items()},
                       os.path.join(args.ckpt_dir, f"heads_rank{rank}_of{world}.pt"))
            if rank == 0:
                torch.save({"round": rnd + 1, "body": global_body.state_dict()},
                           os.path.join(args.ckpt_dir, "global.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
