#!/usr/bin/env python
"""CIFAR10-DVS with a PLIF spiking ResNet-ish net (spikingjelly, multi-step mode).

CIFAR10-DVS has no official test split: we hold out 10% of the recordings.

torchrun --nproc_per_node=4 06_cifar10dvs_plif.py --root /data/CIFAR10DVS --T 10 --epochs 150
"""
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from spikingjelly.activation_based import functional, layer, neuron, surrogate
from spikingjelly.datasets.cifar10_dvs import CIFAR10DVS
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, random_split
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger(__name__)


def conv_bn(c_in, c_out, stride=1):
    return layer.SeqToANNContainer(
        nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
    )


def plif():
    return neuron.ParametricLIFNode(init_tau=2.0, surrogate_function=surrogate.Sigmoid(alpha=4.0),
                                    detach_reset=True, step_mode="m")


class SEWBlock(nn.Module):
    """Spike-element-wise residual block (ADD connect)."""

    def __init__(self, ch):
        super().__init__()
        self.c1, self.n1 = conv_bn(ch, ch), plif()
        self.c2, self.n2 = conv_bn(ch, ch), plif()

    def forward(self, x):
        return self.n2(self.c2(self.n1(self.c1(x)))) + x


class DVSNet(nn.Module):
    def __init__(self, ch=64, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(conv_bn(2, ch), plif())
        stages = []
        for i in range(4):
            stages += [SEWBlock(ch), conv_bn(ch, ch, stride=2), plif()]
        self.body = nn.Sequential(*stages)
        self.head = nn.Sequential(layer.Flatten(), layer.SeqToANNContainer(nn.Linear(ch * 4 * 4, num_classes)))
        functional.set_step_mode(self, "m")

    def forward(self, x):  # [N, T, 2, 128, 128]
        x = x.transpose(0, 1)
        x = F.avg_pool2d(x.flatten(0, 1), 2).view(x.shape[0], x.shape[1], 2, 64, 64).contiguous()
        feat = self.body(self.stem(x))
        return self.head(feat).mean(0)


def gpu_augment(x):
    """Per-sample horizontal flip plus a +-5 px roll of the batch, same for all time steps."""
    n = x.shape[0]
    flip = torch.rand(n, device=x.device) < 0.5
    x = torch.where(flip[:, None, None, None, None], x.flip(-1), x)
    dx, dy = torch.randint(-5, 6, (2,)).tolist()
    return torch.roll(x, shifts=(dy, dx), dims=(-2, -1))


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--T", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=16, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.1, help="SGD lr for global batch 256")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--holdout", type=float, default=0.1)
    ap.add_argument("--out", default="runs/c10dvs")
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[%(asctime)s r{rank}] %(message)s")
    # different augmentation stream on every rank
    torch.manual_seed(args.seed + rank)

    # frames are integrated and written to disk on first use; only rank 0 does that
    if rank == 0:
        CIFAR10DVS(args.root, data_type="frame", frames_number=args.T, split_by="number")
    dist.barrier()
    full = CIFAR10DVS(args.root, data_type="frame", frames_number=args.T, split_by="number")

    n_test = int(len(full) * args.holdout)
    train_set, test_set = random_split(full, [len(full) - n_test, n_test])
    logger.info("train %d / held-out %d recordings", len(train_set), len(test_set))

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_part = Subset(test_set, range(rank, len(test_set), world))
    test_loader = DataLoader(test_part, batch_size=args.batch_size * 2, shuffle=False,
                             num_workers=args.workers, pin_memory=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(DVSNet()).to(device)
    model = DDP(net, device_ids=[local_rank])

    global_bs = args.batch_size * world
    lr = args.lr * global_bs / 256
    decay, no_decay = [], []
    for n_, p in model.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)  # BN and PLIF tau
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    logger.info("global batch %d, lr %.4f", global_bs, lr)

    os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        meter = torch.zeros(3, device=device)
        for frames, label in train_loader:
            frames = gpu_augment(frames.to(device, non_blocking=True).float())
            label = label.to(device, non_blocking=True)
            out = model(frames)
            loss = F.cross_entropy(out, label)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            functional.reset_net(model)
            meter += torch.stack([loss.detach() * label.numel(),
                                  (out.argmax(1) == label).sum().float(),
                                  torch.tensor(float(label.numel()), device=device)])
        scheduler.step()
        dist.all_reduce(meter)

        model.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad():
            for frames, label in test_loader:
                frames, label = frames.to(device).float(), label.to(device)
                out = model.module(frames)
                functional.reset_net(model.module)
                hits[0] += (out.argmax(1) == label).sum()
                hits[1] += label.numel()
        dist.all_reduce(hits)
        test_acc = (hits[0] / hits[1]).item()

        logger.info("ep %d loss %.4f train_acc %.4f test_acc %.4f %.0fs", epoch,
                    (meter[0] / meter[2]).item(), (meter[1] / meter[2]).item(), test_acc, time.time() - tic)
        if rank == 0:
            ck = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                  "scheduler": scheduler.state_dict(), "epoch": epoch, "test_acc": test_acc}
            torch.save(ck, os.path.join(args.out, "last.pth"))
            if test_acc > best:
                best = test_acc
                torch.save(ck, os.path.join(args.out, "best.pth"))

    logger.info("best held-out acc %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
