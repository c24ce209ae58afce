"""PBT on SVHN with in-memory exploitation: no checkpoint files.

Weights of a donor member are sent to the member that exploits it with NCCL
broadcasts.  Every rank computes the same (loser, donor) pairs from the
gathered scores and takes part in every broadcast; ranks that are neither the
donor nor the loser receive into a scratch tensor and drop it.

The run stops for the whole population as soon as any member reaches
``--target-acc`` (decided with an all_reduce, so all ranks leave together).

    torchrun --nproc_per_node=8 pbt_svhn.py --epochs 50 --target-acc 0.975
"""
import argparse
import json
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./data/svhn")
    ap.add_argument("--out", default="runs/pbt_svhn")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--interval", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--target-acc", type=float, default=0.975)
    ap.add_argument("--seed", type=int, default=5)
    return ap.parse_args()


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(out)) + self.short(x))


class ResNet20(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        layers, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                layers.append(BasicBlock(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def make_data(args, rank):
    norm = T.Normalize((0.438, 0.444, 0.473), (0.198, 0.201, 0.197))
    if rank == 0:
        for split in ("train", "test"):
            torchvision.datasets.SVHN(args.data, split=split, download=True)
    dist.barrier()
    train = torchvision.datasets.SVHN(args.data, split="train",
                                      transform=T.Compose([T.RandomCrop(32, 2), T.ToTensor(), norm]))
    test = torchvision.datasets.SVHN(args.data, split="test", transform=T.Compose([T.ToTensor(), norm]))
    return (DataLoader(train, args.batch_size, shuffle=True, num_workers=6, pin_memory=True,
                       drop_last=True, persistent_workers=True),
            DataLoader(test, 1000, num_workers=4, pin_memory=True))


@torch.no_grad()
def accuracy(model, loader, device):
    model.eval()
    hit = torch.zeros((), device=device)
    n = 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        hit += (model(x).argmax(1) == y).sum()
        n += y.numel()
    model.train()
    return hit.item() / n


def lr_at(step, total, base_lr):
    return base_lr * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))


@torch.no_grad()
def send_member(model, donor, loser, rank):
    """Copy parameters and buffers of `donor` into `loser`; all ranks must call."""
    for name, tensor in model.state_dict().items():
        buf = tensor if rank == donor else torch.empty_like(tensor)
        dist.broadcast(buf, src=donor)
        if rank == loser:
            tensor.copy_(buf)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    rng = random.Random(args.seed * 131 + rank)
    torch.manual_seed(args.seed * 131 + rank)

    hp = {"lr": 10 ** rng.uniform(-1.7, -0.5), "momentum": rng.uniform(0.85, 0.97),
          "weight_decay": 10 ** rng.uniform(-4.5, -3.3)}
    train_loader, test_loader = make_data(args, rank)
    model = ResNet20().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=hp["lr"], momentum=hp["momentum"],
                          weight_decay=hp["weight_decay"], nesterov=True)
    total_steps = args.epochs * len(train_loader)

    step, acc, trace = 0, 0.0, []
    for epoch in range(1, args.epochs + 1):
        t0 = time.time()
        model.train()
        for x, y in train_loader:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, total_steps, hp["lr"])
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1

        acc = accuracy(model, test_loader, device)
        trace.append({"epoch": epoch, "acc": acc, **hp})
        print(f"[m{rank}] epoch {epoch} acc {acc:.4f} ({time.time() - t0:.0f}s)", flush=True)

        done = torch.tensor([1.0 if acc >= args.target_acc else 0.0], device=device)
        dist.all_reduce(done, op=dist.ReduceOp.MAX)
        if done.item() > 0 or epoch == args.epochs:
            break
        if epoch % args.interval:
            continue

        scores = [None] * world
        dist.all_gather_object(scores, acc)
        order = sorted(range(world), key=lambda r: (-scores[r], r))
        k = max(1, world // 4)
        pairs = list(zip(order[-k:], order[:k]))  # (loser, donor), same on every rank

        for loser, donor in pairs:
            send_member(model, donor, loser, rank)
            obj = [hp if rank == donor else None]
            dist.broadcast_object_list(obj, src=donor)
            if rank == loser:
                hp = {"lr": obj[0]["lr"] * rng.choice([0.8, 1.25]),
                      "momentum": min(0.99, obj[0]["momentum"] * rng.choice([0.98, 1.02])),
                      "weight_decay": obj[0]["weight_decay"] * rng.choice([0.8, 1.25])}
                for g in opt.param_groups:
                    g["momentum"], g["weight_decay"] = hp["momentum"], hp["weight_decay"]
                opt.state.clear()  # momentum buffers belong to the old weights
                print(f"[m{rank}] <- m{donor} ({scores[donor]:.4f}), lr {hp['lr']:.3g}", flush=True)

    finals = [None] * world
    dist.all_gather_object(finals, {"member": rank, "acc": acc, "hp": hp, "trace": trace})
    winner = max(finals, key=lambda d: (d["acc"], -d["member"]))
    if rank == winner["member"]:
        os.makedirs(args.out, exist_ok=True)
        torch.save({"model": model.state_dict(), "hp": hp, "acc": acc},
                   os.path.join(args.out, "best_member.pt"))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "population.json"), "w") as f:
            json.dump(finals, f, indent=2)
        print(f"winner m{winner['member']} acc {winner['acc']:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
