#!/usr/bin/env python
# Spiking VGG-11 on N-Caltech101 with our own stateful LIF layer (membrane kept
# in the module, cleared with reset_states() before every new sample batch).
#
# torchrun --nproc_per_node=8 06_ncaltech101_stateful_lif.py --root /data/ncaltech101 --T 10
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, random_split
from torch.utils.data.distributed import DistributedSampler

from spikingjelly.datasets.n_caltech101 import NCaltech101


class SigmoidSurrogate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha):
        ctx.save_for_backward(x)
        ctx.alpha = alpha
        return (x > 0).float()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(ctx.alpha * x)
        return grad * ctx.alpha * s * (1 - s), None


class StatefulLIF(nn.Module):
    def __init__(self, tau=2.0, v_th=1.0, alpha=4.0):
        super().__init__()
        self.tau, self.v_th, self.alpha = tau, v_th, alpha
        self.v = None

    def reset(self):
        self.v = None

    def forward(self, x):
        if self.v is None:
            self.v = torch.zeros_like(x)
        self.v = self.v + (x - self.v) / self.tau
        spike = SigmoidSurrogate.apply(self.v - self.v_th, self.alpha)
        self.v = self.v * (1.0 - spike.detach())  # hard reset, reset path not differentiated
        return spike


CFG_VGG11 = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]


class SpikingVGG(nn.Module):
    def __init__(self, num_classes=101, tau=2.0):
        super().__init__()
        layers, cin = [], 2
        for v in CFG_VGG11:
            if v == "M":
                layers.append(nn.AvgPool2d(2))
            else:
                layers += [nn.Conv2d(cin, v, 3, padding=1, bias=False), nn.BatchNorm2d(v), StatefulLIF(tau)]
                cin = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(0.3), nn.Linear(512 * 4 * 4, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def reset_states(self):
        for m in self.modules():
            if isinstance(m, StatefulLIF):
                m.reset()

    def forward(self, x_seq):
        # x_seq: [N, T, 2, H, W]; one network step per frame, logits averaged over time
        out = 0.0
        for t in range(x_seq.size(1)):
            out = out + self.classifier(self.features(x_seq[:, t]))
        return out / x_seq.size(1)


def frames_to_input(frames, device, size=128):
    x = frames.to(device, non_blocking=True).float()
    n, t = x.shape[:2]
    x = F.interpolate(x.flatten(0, 1), size=(size, size), mode="bilinear", align_corners=False)
    return (x.view(n, t, *x.shape[1:]) > 0).float()


def train_one_epoch(model, loader, optimizer, scheduler, device, epoch, rank):
    model.train()
    t0 = time.time()
    meter = torch.zeros(3, device=device)
    for it, (frames, labels) in enumerate(loader):
        x = frames_to_input(frames, device)
        labels = labels.to(device, non_blocking=True)
        model.reset_states()
        logits = model(x)
        loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        meter += torch.stack([loss.detach() * labels.numel(), (logits.argmax(1) == labels).sum().float(),
                              torch.tensor(float(labels.numel()), device=device)])
        if rank == 0 and it % 50 == 0:
            print(f"  ep {epoch} it {it}/{len(loader)} loss {loss.item():.3f} lr {scheduler.get_last_lr()[0]:.2e}",
                  flush=True)
    dist.all_reduce(meter)
    if rank == 0:
        print(f"epoch {epoch} train loss {meter[0] / meter[2]:.4f} acc {meter[1] / meter[2]:.4f} "
              f"({time.time() - t0:.0f}s)", flush=True)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    hits = torch.zeros(2, device=device)
    for frames, labels in loader:
        x = frames_to_input(frames, device)
        labels = labels.to(device)
        net.reset_states()
        hits[0] += (net(x).argmax(1) == labels).sum()
        hits[1] += labels.numel()
    dist.all_reduce(hits)
    return (hits[0] / hits[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--T", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--save-dir", default="checkpoints/ncaltech_vgg11")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        NCaltech101(args.root, data_type="frame", frames_number=args.T, split_by="number")
    dist.barrier()
    full = NCaltech101(args.root, data_type="frame", frames_number=args.T, split_by="number")
    n_test = int(0.2 * len(full))
    # fixed generator -> identical split on every rank
    train_set, test_set = random_split(full, [len(full) - n_test, n_test], generator=torch.Generator().manual_seed(42))

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    test_indices = list(range(rank, n_test, world_size))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, test_indices), batch_size=args.batch_size,
                             num_workers=args.workers, pin_memory=True)

    model = SpikingVGG()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    total_steps = args.epochs * len(train_loader)
    warmup = len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / total_steps)))

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        train_one_epoch(model, train_loader, optimizer, scheduler, device, epoch, rank)
        acc = evaluate(model.module, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch} test acc {acc:.4f}", flush=True)
            if acc > best:
                best = acc
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "acc": acc},
                           os.path.join(args.save_dir, "best.pth"))
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()}, os.path.join(args.save_dir, "last.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
