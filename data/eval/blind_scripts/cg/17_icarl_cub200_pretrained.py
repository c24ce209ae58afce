"""iCaRL with an ImageNet pre-trained ResNet-50 on CUB-200-2011 (10 tasks x 20 classes).

- class order drawn once on rank 0 and broadcast (use --order-seed to reproduce)
- exemplar features are computed in parallel (each rank embeds a slice of a class) and
  gathered, so every rank runs identical herding and holds the same memory
- NME and CNN accuracy per task, accuracy matrix + average forgetting

    torchrun --nproc_per_node=8 17_icarl_cub200_pretrained.py --root /data/CUB_200_2011 --out runs/icarl_cub
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.datasets import ImageFolder
from torchvision.models import ResNet50_Weights, resnet50


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, help="CUB root with train/ and test/ ImageFolders")
    ap.add_argument("--out", default="runs/icarl_cub")
    ap.add_argument("--tasks", type=int, default=10)
    ap.add_argument("--memory", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--order-seed", type=int, default=None)
    ap.add_argument("--resume", default=None)
    return ap.parse_args()


class Model(nn.Module):
    def __init__(self, weights=None):
        super().__init__()
        self.encoder = resnet50(weights=weights)
        self.encoder.fc = nn.Identity()
        self.fc = nn.Linear(2048, 0)

    def expand(self, n):
        fc = nn.Linear(2048, self.fc.out_features + n).to(self.fc.weight.device)
        fc.weight.data[: self.fc.out_features] = self.fc.weight.data
        fc.bias.data[: self.fc.out_features] = self.fc.bias.data
        self.fc = fc

    def embed(self, x):
        return F.normalize(self.encoder(x), dim=1)

    def forward(self, x):
        return self.fc(self.encoder(x))


def gather_uneven(t):
    """all_gather for tensors whose first dimension differs between ranks."""
    world = dist.get_world_size()
    n = torch.tensor([t.size(0)], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = [int(s) for s in sizes]
    m = max(sizes)
    padded = torch.cat([t, t.new_zeros((m - t.size(0),) + tuple(t.shape[1:]))])
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[:s] for o, s in zip(out, sizes)])


@torch.no_grad()
def class_features(net, ds, idx, device, rank, world):
    net.eval()
    mine = idx[rank::world]
    feats = torch.zeros(0, 2048, device=device)
    if len(mine):
        feats = torch.cat([net.embed(x.to(device)) for x, _ in
                           DataLoader(Subset(ds, mine), batch_size=64, num_workers=4)])
    return gather_uneven(feats), np.concatenate([idx[r::world] for r in range(world)])


def herding(f, m):
    mu, acc, picks = f.mean(0), torch.zeros_like(f[0]), []
    for k in range(1, min(m, len(f)) + 1):
        d = (mu - (acc + f) / k).norm(dim=1)
        if picks:
            d[picks] = float("inf")
        picks.append(int(d.argmin()))
        acc += f[picks[-1]]
    return picks


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train = ImageFolder(os.path.join(args.root, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.35, 1)), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), norm]))
    plain = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    train_plain = ImageFolder(os.path.join(args.root, "train"), plain)
    test = ImageFolder(os.path.join(args.root, "test"), plain)
    n_cls = len(train.classes)

    obj = [None]
    if rank == 0:
        obj = [np.random.RandomState(args.order_seed).permutation(n_cls).tolist()]
    dist.broadcast_object_list(obj, src=0)  # uses the current device set above
    order = np.asarray(obj[0])
    pos = np.argsort(order)
    ytr, yte = pos[np.asarray(train.targets)], pos[np.asarray(test.targets)]
    for ds in (train, train_plain, test):
        ds.target_transform = lambda y: int(pos[y])
    cpt = n_cls // args.tasks

    if rank == 0:
        resnet50(weights=ResNet50_Weights.IMAGENET1K_V2)  # download the weights once
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()
    net = Model(weights=ResNet50_Weights.IMAGENET1K_V2).to(device)
    old, memory, start = None, {}, 0
    A = np.zeros((args.tasks, args.tasks))
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        net.expand(ck["n_classes"])
        net.load_state_dict(ck["model"])
        memory = {int(k): v for k, v in ck["memory"].items()}
        A, start = np.asarray(ck["A"]), ck["task"] + 1
        order, pos = np.asarray(ck["order"]), np.argsort(ck["order"])
        ytr, yte = pos[np.asarray(train.targets)], pos[np.asarray(test.targets)]
        old = copy.deepcopy(net).eval().requires_grad_(False)

    for t in range(start, args.tasks):
        lo, hi = t * cpt, (t + 1) * cpt
        net.expand(cpt)
        model = DDP(net, device_ids=[local_rank])
        idx = np.flatnonzero((ytr >= lo) & (ytr < hi)).tolist() + [i for c in sorted(memory) for i in memory[c]]
        ds = Subset(train, idx)
        sampler = DistributedSampler(ds, shuffle=True, seed=t)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                            pin_memory=True, drop_last=True)
        opt = torch.optim.SGD([{"params": net.encoder.parameters(), "lr": args.lr},
                               {"params": net.fc.parameters(), "lr": args.lr * 10}],
                              momentum=0.9, weight_decay=5e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)
        for ep in range(args.epochs):
            model.train()
            sampler.set_epoch(ep)
            tic = time.time()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits = model(x)
                target = F.one_hot(y, hi).float()
                if old is not None:
                    with torch.no_grad():
                        target[:, :lo] = torch.sigmoid(old(x))
                loss = F.binary_cross_entropy_with_logits(logits, target)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            sched.step()
            if rank == 0:
                print(f"task {t} ep {ep} loss {loss.item():.4f} ({time.time() - tic:.0f}s)", flush=True)

        m = args.memory // hi
        for c in memory:
            memory[c] = memory[c][:m]
        means = torch.zeros(hi, 2048, device=device)
        for c in range(hi):
            pool = np.flatnonzero(ytr == c) if c >= lo else np.asarray(memory[c])
            f, order_idx = class_features(net, train_plain, pool, device, rank, world)
            if c >= lo:
                memory[c] = order_idx[herding(f, m)].tolist()
            where = {int(v): i for i, v in enumerate(order_idx)}
            means[c] = F.normalize(f[[where[i] for i in memory[c]]].mean(0), dim=0)

        net.eval()
        for j in range(t + 1):
            tj = np.flatnonzero((yte >= j * cpt) & (yte < (j + 1) * cpt))[rank::world]
            s = torch.zeros(3, device=device)
            with torch.no_grad():
                for x, y in DataLoader(Subset(test, tj), batch_size=64, num_workers=4):
                    x, y = x.to(device), y.to(device)
                    s[0] += ((net.embed(x) @ means.T).argmax(1) == y).sum()
                    s[1] += (net(x).argmax(1) == y).sum()
                    s[2] += len(y)
            dist.all_reduce(s)
            A[t, j] = (100 * s[0] / s[2]).item()
            if rank == 0:
                print(f"  task {j}: NME {A[t, j]:.2f}  CNN {(100 * s[1] / s[2]).item():.2f}")
        if rank == 0:
            fgt = np.mean([A[j:t, j].max() - A[t, j] for j in range(t)]) if t else 0.0
            print(f"== after task {t}: NME avg {A[t, :t + 1].mean():.2f} forgetting {fgt:.2f}", flush=True)
            torch.save({"model": net.state_dict(), "n_classes": hi, "memory": memory, "A": A,
                        "task": t, "order": order.tolist()}, os.path.join(args.out, f"task{t}.pt"))
            with open(os.path.join(args.out, "A.json"), "w") as fh:
                json.dump(A.tolist(), fh)
        dist.barrier()
        old = copy.deepcopy(net).eval().requires_grad_(False)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
