"""Two-phase one-shot NAS on CIFAR-10.

Phase 1 trains a weight-sharing supernet (uniform single-path sampling).
Phase 2 loads the trained supernet and ranks random sub-networks by their
inherited-weight validation accuracy.  Phase 2 can be rerun alone with
--skip-train --supernet-ckpt PATH.

    torchrun --standalone --nproc_per_node=8 15_supernet_train_then_rank.py --out runs/oneshot_c10
"""
import argparse
import json
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

OPS = ["conv3", "conv5", "sep3", "sep5", "skip"]


def make_op(name, c):
    if name == "skip":
        return nn.Identity()
    k = 3 if name.endswith("3") else 5
    if name.startswith("conv"):
        return nn.Sequential(nn.Conv2d(c, c, k, padding=k // 2, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True))
    return nn.Sequential(nn.Conv2d(c, c, k, padding=k // 2, groups=c, bias=False), nn.Conv2d(c, c, 1, bias=False),
                         nn.BatchNorm2d(c), nn.ReLU(inplace=True))


class Supernet(nn.Module):
    def __init__(self, width=64, layers_per_stage=4, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        self.stages, self.downs = nn.ModuleList(), nn.ModuleList()
        c = width
        for s in range(3):
            self.stages.append(nn.ModuleList(nn.ModuleList(make_op(o, c) for o in OPS) for _ in range(layers_per_stage)))
            if s < 2:
                self.downs.append(nn.Sequential(nn.Conv2d(c, 2 * c, 3, 2, 1, bias=False), nn.BatchNorm2d(2 * c), nn.ReLU(inplace=True)))
                c *= 2
        self.fc = nn.Linear(c, num_classes)
        self.n_layers = 3 * layers_per_stage

    def forward(self, x, arch):
        x = self.stem(x)
        i = 0
        for s, stage in enumerate(self.stages):
            for choices in stage:
                x = choices[arch[i]](x)
                i += 1
            if s < len(self.downs):
                x = self.downs[s](x)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def get_data(args, rank, world):
    norm = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    train_tf = transforms.Compose([transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
    plain_tf = transforms.Compose([transforms.ToTensor(), norm])
    if rank == 0:
        datasets.CIFAR10(args.data, train=True, download=True)
    dist.barrier()
    full_aug = datasets.CIFAR10(args.data, train=True, transform=train_tf)
    full_plain = datasets.CIFAR10(args.data, train=True, transform=plain_tf)
    train_set = Subset(full_aug, range(0, 45000))
    val_set = Subset(full_plain, range(45000 + rank, 50000, world))
    return train_set, val_set, train_set


def train_supernet(args, train_set, device, local_rank, rank):
    net = Supernet().to(device)
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, args.bs, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, tot = time.time(), torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            rng = random.Random(args.seed * 1_000_003 + step)  # same path on every rank
            arch = [rng.randrange(len(OPS)) for _ in range(net.n_layers)]
            loss = F.cross_entropy(model(x, arch), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
            step += 1
        sched.step()
        dist.all_reduce(tot)
        if rank == 0:
            print(f"[supernet] epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} ({time.time() - t0:.0f}s)", flush=True)

    path = os.path.join(args.out, "supernet.pt")
    if rank == 0:
        torch.save(model.state_dict(), path)
    dist.barrier()
    del model, opt
    return path


@torch.no_grad()
def calibrate_and_score(net, arch, calib_loader, val_loader, device, calib_batches=10):
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None
    net.train()
    for i, (x, _) in enumerate(calib_loader):
        if i == calib_batches:
            break
        net(x.to(device, non_blocking=True), arch)
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            dist.all_reduce(m.running_mean, op=dist.ReduceOp.AVG)
            dist.all_reduce(m.running_var, op=dist.ReduceOp.AVG)
    net.eval()
    c = torch.zeros(2, device=device)
    for x, y in val_loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        c[0] += (net(x, arch).argmax(1) == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


def rank_subnets(args, path, val_set, calib_set, device, rank):
    net = Supernet().to(device)
    net.load_state_dict(torch.load(path, map_location=device))
    # fixed sampler epoch: every sub-network is calibrated on the same images
    calib_sampler = DistributedSampler(calib_set, shuffle=True, seed=123)
    calib_loader = DataLoader(calib_set, 128, sampler=calib_sampler, num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_set, 500, num_workers=4, pin_memory=True)
    rng = random.Random(args.seed)
    results = []
    for k in range(args.num_subnets):
        arch = [rng.randrange(len(OPS)) for _ in range(net.n_layers)]
        acc = calibrate_and_score(net, arch, calib_loader, val_loader, device)
        results.append({"arch": [OPS[a] for a in arch], "val_acc": acc})
        if rank == 0 and k % 50 == 0:
            print(f"[rank] {k}/{args.num_subnets} last {acc:.4f}", flush=True)
    results.sort(key=lambda r: -r["val_acc"])
    if rank == 0:
        with open(os.path.join(args.out, "subnet_ranking.json"), "w") as f:
            json.dump(results, f, indent=1)
        print("top-5:", json.dumps(results[:5], indent=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./data")
    ap.add_argument("--out", default="runs/oneshot_c10")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--bs", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.2)
    ap.add_argument("--num-subnets", type=int, default=500)
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--supernet-ckpt", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    train_set, val_set, calib_set = get_data(args, rank, world)
    if args.skip_train:
        path = args.supernet_ckpt
    else:
        path = train_supernet(args, train_set, device, local_rank, rank)
    rank_subnets(args, path, val_set, calib_set, device, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
