"""Learning Loss for Active Learning (Yoo & Kweon, CVPR 2019), distributed version.

A loss-prediction module is trained jointly with the target ResNet-18; each
cycle the unlabelled SUBSET with the highest predicted loss is queried.

    torchrun --standalone --nproc_per_node=4 07_learning_loss_cifar10.py --cycles 10 --amp
"""
import argparse
import contextlib
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms
from torchvision.models import resnet18


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data/cifar10")
    p.add_argument("--out", default="./runs/ll4al")
    p.add_argument("--cycles", type=int, default=10)
    p.add_argument("--init_size", type=int, default=1000)
    p.add_argument("--addendum", type=int, default=1000)
    p.add_argument("--subset", type=int, default=10000)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--epoch_loss", type=int, default=120, help="after this, stop gradient from the loss module into the backbone")
    p.add_argument("--margin", type=float, default=1.0)
    p.add_argument("--weight", type=float, default=1.0)
    p.add_argument("--batch", type=int, default=128, help="global batch")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--resume", default="")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class ResNetTaps(nn.Module):
    """ResNet-18 for 32x32 inputs that also returns the four stage outputs."""

    def __init__(self, num_classes=10):
        super().__init__()
        r = resnet18(num_classes=num_classes)
        r.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu)
        self.layers = nn.ModuleList([r.layer1, r.layer2, r.layer3, r.layer4])
        self.fc = r.fc

    def forward(self, x):
        x = self.stem(x)
        feats = []
        for layer in self.layers:
            x = layer(x)
            feats.append(x)
        out = self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        return out, feats


class LossNet(nn.Module):
    def __init__(self, channels=(64, 128, 256, 512), dim=128):
        super().__init__()
        self.fcs = nn.ModuleList([nn.Linear(c, dim) for c in channels])
        self.out = nn.Linear(dim * len(channels), 1)

    def forward(self, feats):
        hs = [F.relu(fc(torch.flatten(F.adaptive_avg_pool2d(f, 1), 1))) for fc, f in zip(self.fcs, feats)]
        return self.out(torch.cat(hs, 1)).view(-1)


class Learner(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = ResNetTaps()
        self.lossnet = LossNet()

    def forward(self, x, detach_feats=False):
        logits, feats = self.backbone(x)
        if detach_feats:
            feats = [f.detach() for f in feats]
        return logits, self.lossnet(feats)


def loss_pred_loss(pred, target, margin):
    n = pred.size(0) // 2 * 2
    pred, target = pred[:n], target[:n]
    p_i, p_j = pred[: n // 2], pred.flip(0)[: n // 2]
    t_i, t_j = target[: n // 2], target.flip(0)[: n // 2]
    sign = 2 * torch.sign(torch.clamp(t_i - t_j, min=0)) - 1
    return torch.clamp(margin - sign * (p_i - p_j), min=0).mean()


def train_cycle(model, loader, sampler, args, device):
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[160])
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    n_batches = len(loader)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        opt.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync_now = (i + 1) % args.accum == 0 or (i + 1) == n_batches
            ctx = contextlib.nullcontext() if sync_now else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                    logits, pred_loss = model(x, detach_feats=epoch >= args.epoch_loss)
                    target_loss = F.cross_entropy(logits, y, reduction="none")
                    loss = target_loss.mean() + args.weight * loss_pred_loss(
                        pred_loss.float(), target_loss.detach().float(), args.margin)
                scaler.scale(loss / args.accum).backward()
            if sync_now:
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
        sched.step()


def gather_uneven(t, world):
    """all_gather for 1-D tensors whose length differs between ranks."""
    n = torch.tensor([t.numel()], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = [int(s) for s in sizes]
    padded = torch.zeros(max(sizes), dtype=t.dtype, device=t.device)
    padded[: t.numel()] = t
    out = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[:s] for o, s in zip(out, sizes)])


@torch.no_grad()
def predicted_losses(net, dataset, indices, device):
    loader = DataLoader(Subset(dataset, indices), batch_size=512, num_workers=4, pin_memory=True)
    net.eval()
    return torch.cat([net(x.to(device, non_blocking=True))[1].float() for x, _ in loader])


@torch.no_grad()
def accuracy(net, dataset, rank, world, device):
    idx = list(range(rank, len(dataset), world))  # no padding: every test image counted once
    loader = DataLoader(Subset(dataset, idx), batch_size=500, num_workers=4)
    net.eval()
    stats = torch.zeros(2, device=device)
    for x, y in loader:
        y = y.to(device)
        stats[0] += (net(x.to(device))[0].argmax(1) == y).sum()
        stats[1] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    norm = transforms.Normalize([0.4914, 0.4822, 0.4465], [0.2023, 0.1994, 0.2010])
    train_tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.RandomCrop(32, 4),
                                   transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.ToTensor(), norm])
    train_set = datasets.CIFAR10(args.data, train=True, transform=train_tf)
    unlab_set = datasets.CIFAR10(args.data, train=True, transform=test_tf)
    test_set = datasets.CIFAR10(args.data, train=False, transform=test_tf)

    all_idx = np.random.RandomState(args.seed).permutation(len(train_set)).tolist()
    labelled, unlabelled = all_idx[:args.init_size], all_idx[args.init_size:]
    start = 0
    state = None
    if args.resume:
        state = torch.load(args.resume, map_location=device)
        labelled, unlabelled, start = state["labelled"], state["unlabelled"], state["cycle"] + 1

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(Learner()).to(device)
    if state is not None:
        net.load_state_dict(state["model"])
    model = DDP(net, device_ids=[local_rank])

    per_gpu = args.batch // (world * args.accum)
    for cycle in range(start, args.cycles):
        t0 = time.time()
        ds = Subset(train_set, labelled)
        sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
        loader = DataLoader(ds, batch_size=per_gpu, sampler=sampler, num_workers=4,
                            pin_memory=True, drop_last=True)
        train_cycle(model, loader, sampler, args, device)
        acc = accuracy(net, test_set, rank, world, device)
        if rank == 0:
            print(f"cycle {cycle + 1}/{args.cycles} labelled {len(labelled)} acc {acc:.4f} "
                  f"({(time.time() - t0) / 60:.1f} min)", flush=True)
            torch.save({"model": net.state_dict(), "labelled": labelled, "unlabelled": unlabelled,
                        "cycle": cycle}, os.path.join(args.out, "ckpt.pt"))
            with open(os.path.join(args.out, "acc.jsonl"), "a") as f:
                f.write(json.dumps({"cycle": cycle, "n": len(labelled), "acc": acc}) + "\n")

        # random SUBSET of the unlabelled pool; same generator state on all ranks
        rng = np.random.RandomState(args.seed * 1000 + cycle)
        rng.shuffle(unlabelled)
        subset = unlabelled[:args.subset]
        mine = subset[rank::world]
        local_pos = torch.arange(rank, len(subset), world, device=device)
        uncert = predicted_losses(net, unlab_set, mine, device)
        uncert = gather_uneven(uncert, world)
        positions = gather_uneven(local_pos, world)
        order = positions[torch.argsort(uncert, descending=True)].tolist()
        picked = set(order[:args.addendum])
        labelled += [subset[j] for j in order[:args.addendum]]
        unlabelled = [subset[j] for j in range(len(subset)) if j not in picked] + unlabelled[args.subset:]

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
