"""PBT where every population member is itself data-parallel.

The world is cut into ``world_size / gpus_per_member`` members; each member is
a DDP model on its own process subgroup.  Exploit/explore runs every
``--ready`` epochs: group leaders write checkpoints of the top members, the
ranks of the bottom members load one of them and perturb lr / weight decay /
head dropout.

    torchrun --nproc_per_node=8 pbt_groups.py --gpus-per-member 2 --data /datasets/tiny-imagenet-200
"""
import argparse
import json
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/datasets/tiny-imagenet-200")
    ap.add_argument("--out", default="runs/pbt_groups")
    ap.add_argument("--gpus-per-member", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--ready", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=128, help="per GPU")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class Classifier(nn.Module):
    def __init__(self, num_classes, dropout):
        super().__init__()
        backbone = torchvision.models.resnet50(weights=None)
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(2048, num_classes)

    def set_dropout(self, p):
        self.dropout.p = p

    def forward(self, x):
        return self.fc(self.dropout(self.backbone(x)))


def loaders(args, group_rank, group_size):
    norm = T.Normalize((0.480, 0.448, 0.398), (0.277, 0.269, 0.282))
    train_ds = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "train"),
        T.Compose([T.RandomResizedCrop(64, scale=(0.35, 1)), T.RandomHorizontalFlip(),
                   T.ToTensor(), norm]))
    val_ds = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "val"), T.Compose([T.ToTensor(), norm]))
    # shard within the member's group only
    train_sampler = DistributedSampler(train_ds, num_replicas=group_size, rank=group_rank,
                                       shuffle=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=group_size, rank=group_rank,
                                     shuffle=False)
    return (DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                       num_workers=6, pin_memory=True, drop_last=True),
            DataLoader(val_ds, batch_size=250, sampler=val_sampler, num_workers=4,
                       pin_memory=True),
            train_sampler, len(train_ds.classes))


@torch.no_grad()
def evaluate(model, loader, device, group):
    model.eval()
    c = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        c[0] += (model(x).argmax(1) == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c, group=group)
    return (c[0] / c[1]).item()


def set_optim_hparams(opt, hp):
    for g in opt.param_groups:
        g["lr"] = hp["lr"]
        g["weight_decay"] = hp["weight_decay"]


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    G = args.gpus_per_member
    assert world % G == 0, "world size must be a multiple of gpus-per-member"
    n_members = world // G
    member, group_rank = rank // G, rank % G
    # every rank must create every group, in the same order
    groups = [dist.new_group(list(range(m * G, (m + 1) * G))) for m in range(n_members)]
    my_group = groups[member]
    is_leader = group_rank == 0

    # all ranks of one member draw the same numbers
    rng = random.Random(args.seed * 7 + member)
    hp = {"lr": 10 ** rng.uniform(-2, -0.7), "weight_decay": 10 ** rng.uniform(-5, -3.3),
          "dropout": rng.uniform(0.0, 0.5)}

    train_loader, val_loader, train_sampler, n_cls = loaders(args, group_rank, G)
    torch.manual_seed(args.seed + member)
    model = Classifier(n_cls, hp["dropout"]).to(device)
    model = DDP(model, device_ids=[local_rank], process_group=my_group)
    opt = torch.optim.SGD(model.parameters(), lr=hp["lr"], momentum=0.9,
                          weight_decay=hp["weight_decay"])

    ck_dir = os.path.join(args.out, "members")
    if rank == 0:
        os.makedirs(ck_dir, exist_ok=True)
    dist.barrier()

    history = []
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        acc = evaluate(model, val_loader, device, my_group)
        history.append({"epoch": epoch, "acc": acc, **hp})
        if is_leader:
            print(f"[member {member}] epoch {epoch} acc {acc:.4f} lr {hp['lr']:.3g} "
                  f"drop {hp['dropout']:.2f}", flush=True)

        if (epoch + 1) % args.ready or epoch + 1 == args.epochs:
            continue

        t = torch.tensor([acc], device=device)
        per_rank = [torch.zeros_like(t) for _ in range(world)]
        dist.all_gather(per_rank, t)
        scores = [per_rank[m * G].item() for m in range(n_members)]
        order = sorted(range(n_members), key=lambda m: (-scores[m], m))
        k = max(1, n_members // 4)
        top, bottom = order[:k], order[-k:]

        if member in top and is_leader:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "hp": hp},
                       os.path.join(ck_dir, f"member{member}.pt"))
        dist.barrier()
        if member in bottom:
            donor = rng.choice(top)
            state = torch.load(os.path.join(ck_dir, f"member{donor}.pt"), map_location=device)
            model.module.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            hp = {"lr": state["hp"]["lr"] * rng.choice([0.8, 1.2]),
                  "weight_decay": state["hp"]["weight_decay"] * rng.choice([0.8, 1.2]),
                  "dropout": min(0.6, max(0.0, state["hp"]["dropout"] + rng.uniform(-0.1, 0.1)))}
            set_optim_hparams(opt, hp)
            model.set_dropout(hp["dropout"])
            if is_leader:
                print(f"[member {member}] exploited member {donor} ({scores[donor]:.4f})",
                      flush=True)
        dist.barrier()

    if is_leader:
        with open(os.path.join(args.out, f"member{member}_history.json"), "w") as f:
            json.dump(history, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
