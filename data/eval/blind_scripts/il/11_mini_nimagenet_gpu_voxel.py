"""Spiking ResNet-18 on mini N-ImageNet (100 classes).

Raw events are loaded by the dataloader workers and voxelised on the GPU
(scatter-add is much faster than doing it in numpy on 640x480 streams).

    torchrun --nproc_per_node=8 11_mini_nimagenet_gpu_voxel.py --root /data/mini_nimagenet
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from spikingjelly.activation_based import functional, layer, neuron, surrogate

SENSOR_H, SENSOR_W = 480, 640


class MiniNImageNet(Dataset):
    def __init__(self, root, split, max_events=150_000, train=False):
        with open(os.path.join(root, f"{split}_list.txt")) as f:
            self.files = [line.strip() for line in f if line.strip()]
        classes = sorted({p.split("/")[-2] for p in self.files})
        self.class_to_idx = {c: i for i, c in enumerate(classes)}
        self.root, self.max_events, self.train = root, max_events, train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        rel = self.files[i]
        ev = np.load(os.path.join(self.root, rel))["event_data"]
        x = ev["x_pos"].astype(np.float32)
        y = ev["y_pos"].astype(np.float32)
        t = ev["timestamp"].astype(np.float64)
        p = ev["polarity"].astype(np.float32)
        if len(t) > self.max_events:
            keep = np.sort(np.random.choice(len(t), self.max_events, replace=False)) if self.train \
                else np.linspace(0, len(t) - 1, self.max_events).astype(np.int64)
            x, y, t, p = x[keep], y[keep], t[keep], p[keep]
        t = (t - t[0]) / max(t[-1] - t[0], 1.0)
        if self.train and np.random.rand() < 0.5:
            x = SENSOR_W - 1 - x
        ev = np.stack([x, y, t.astype(np.float32), p], axis=1)
        return torch.from_numpy(ev), self.class_to_idx[rel.split("/")[-2]]


def collate_events(batch):
    # concatenate variable-length event lists, last column is the batch index
    evs, labels = [], []
    for b, (ev, label) in enumerate(batch):
        evs.append(torch.cat([ev, torch.full((len(ev), 1), float(b))], dim=1))
        labels.append(label)
    return torch.cat(evs), torch.as_tensor(labels)


def events_to_voxel(events, batch_size, bins, height=SENSOR_H, width=SENSOR_W, out_size=224, device="cuda:0"):
    """events [M, 5] (x, y, t in [0,1], p, b) -> [T=bins, B, 2, out_size, out_size]."""
    ev = events.to(device, non_blocking=True)
    x, y, t, p, b = ev.unbind(1)
    tb = (t * bins).long().clamp_(max=bins - 1)
    pol = (p > 0).long()
    vox = torch.zeros(bins, batch_size, 2, height, width, device=device)
    idx = (((tb * batch_size + b.long()) * 2 + pol) * height + y.long()) * width + x.long()
    vox.view(-1).index_add_(0, idx, torch.ones_like(t))
    vox = F.interpolate(vox.flatten(0, 1), size=(out_size, out_size), mode="area")
    vox = vox.view(bins, batch_size, 2, out_size, out_size)
    return torch.log1p(vox)


def lif():
    return neuron.LIFNode(tau=2.0, detach_reset=True, surrogate_function=surrogate.ATan(), step_mode="m")


def conv_bn(cin, cout, k, stride):
    return layer.SeqToANNContainer(nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1, self.sn1 = conv_bn(cin, cout, 3, stride), lif()
        self.conv2, self.sn2 = conv_bn(cout, cout, 3, 1), lif()
        self.down = conv_bn(cin, cout, 1, stride) if (stride != 1 or cin != cout) else None

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        return self.sn2(self.conv2(self.sn1(self.conv1(x))) + identity)


class SpikingResNet18(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.stem = nn.Sequential(conv_bn(2, 64, 7, 2), lif(), layer.SeqToANNContainer(nn.MaxPool2d(3, 2, 1)))
        blocks, cin = [], 64
        for i, c in enumerate((64, 128, 256, 512)):
            blocks += [BasicBlock(cin, c, 1 if i == 0 else 2), BasicBlock(c, c, 1)]
            cin = c
        self.blocks = nn.Sequential(*blocks)
        self.head = layer.SeqToANNContainer(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes))

    def forward(self, x):  # [T, B, 2, H, W] -> [T, B, classes]
        return self.head(self.blocks(self.stem(x)))


def build_model(num_classes):
    return SpikingResNet18(num_classes)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="runs/mini_nin_sres18")
    ap.add_argument("--bins", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=10)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = MiniNImageNet(args.root, "train", train=True)
    val_set = MiniNImageNet(args.root, "val")
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate_events, num_workers=args.workers, pin_memory=True,
                              drop_last=True, persistent_workers=True, prefetch_factor=4)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=args.batch_size, collate_fn=collate_events,
                            num_workers=args.workers, pin_memory=True)

    model = build_model(len(train_set.class_to_idx))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=steps, pct_start=0.05)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (events, labels) in enumerate(train_loader):
            x = events_to_voxel(events, labels.numel(), args.bins)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x).mean(0)
                loss = F.cross_entropy(logits, labels, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            functional.reset_net(model)
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it}/{len(train_loader)} loss {loss.item():.3f} "
                      f"{(it + 1) / (time.time() - tic):.2f} it/s", flush=True)

        model.eval()
        hits = torch.zeros(3, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for events, labels in val_loader:
                x = events_to_voxel(events, labels.numel(), args.bins)
                labels = labels.to(device)
                logits = model.module(x).mean(0)
                functional.reset_net(model)
                top5 = logits.topk(5, dim=1).indices
                hits[0] += (top5[:, 0] == labels).sum()
                hits[1] += (top5 == labels[:, None]).any(1).sum()
                hits[2] += labels.numel()
        dist.all_reduce(hits)
        top1, top5 = (hits[0] / hits[2]).item(), (hits[1] / hits[2]).item()
        if rank == 0:
            print(f"epoch {epoch}: val top1 {top1:.4f} top5 {top5:.4f} ({time.time() - tic:.0f}s)", flush=True)
            state = {"model": model.module.state_dict(), "epoch": epoch, "top1": top1}
            torch.save(state, os.path.join(args.out, "last.pth"))
            if top1 > best:
                best = top1
                torch.save(state, os.path.join(args.out, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
