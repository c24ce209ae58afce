"""Spiking ResNet-19 on CIFAR10-DVS with the TET loss (SpikingJelly).

Frames are resized to 48x48, T=10. Resumes automatically from <out>/last.pth
when it exists, so the job can be requeued by the scheduler.

    torchrun --nproc_per_node=8 10_cifar10dvs_resnet19_tet.py --root /data/CIFAR10DVS --out /ckpt/c10dvs_r19
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from spikingjelly.activation_based import functional, layer, neuron, surrogate
from spikingjelly.datasets import split_to_train_test_set
from spikingjelly.datasets.cifar10_dvs import CIFAR10DVS


def args_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--T", type=int, default=10)
    p.add_argument("--size", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--tet-lambda", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def spiking():
    return neuron.LIFNode(tau=2.0, v_threshold=1.0, detach_reset=True, surrogate_function=surrogate.Sigmoid(alpha=4.0))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv_bn1 = layer.SeqToANNContainer(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout))
        self.sn1 = spiking()
        self.conv_bn2 = layer.SeqToANNContainer(nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = layer.SeqToANNContainer(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        self.sn2 = spiking()

    def forward(self, x):
        out = self.conv_bn2(self.sn1(self.conv_bn1(x)))
        return self.sn2(out + self.shortcut(x))


class ResNet19(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(layer.SeqToANNContainer(nn.Conv2d(2, 128, 3, 1, 1, bias=False), nn.BatchNorm2d(128)),
                                  spiking())
        cfg = [(128, 3, 1), (256, 3, 2), (512, 2, 2)]
        blocks, cin = [], 128
        for cout, n, stride in cfg:
            for i in range(n):
                blocks.append(BasicBlock(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*blocks)
        self.pool = layer.AdaptiveAvgPool2d(1)
        self.fc1 = layer.Linear(512, 256)
        self.sn = spiking()
        self.fc2 = layer.Linear(256, num_classes)
        functional.set_step_mode(self, "m")

    def forward(self, x):
        x = self.pool(self.layers(self.stem(x))).flatten(2)
        return self.fc2(self.sn(self.fc1(x)))  # [T, N, classes]


def tet_loss(out_t, target, lam):
    # TET: CE at every time step + MSE regulariser pulling the outputs towards 1
    T = out_t.size(0)
    ce = sum(F.cross_entropy(out_t[t], target) for t in range(T)) / T
    mse = F.mse_loss(out_t, torch.ones_like(out_t))
    return (1 - lam) * ce + lam * mse


def to_input(frames, size, device, train):
    x = frames.to(device, non_blocking=True).float()  # [N, T, 2, 128, 128]
    N, T = x.shape[:2]
    x = F.interpolate(x.flatten(0, 1), size=(size, size), mode="bilinear", align_corners=False)
    x = x.view(N, T, 2, size, size)
    if train:
        flip = torch.rand(N, device=device) < 0.5
        x[flip] = x[flip].flip(-1)
        shift = torch.randint(-5, 6, (2,)).tolist()
        x = torch.roll(x, shifts=shift, dims=(3, 4))
    return x.transpose(0, 1).contiguous()  # [T, N, ...]


def main():
    args = args_parser()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        CIFAR10DVS(args.root, data_type="frame", frames_number=args.T, split_by="number")
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()
    origin = CIFAR10DVS(args.root, data_type="frame", frames_number=args.T, split_by="number")
    train_set, test_set = split_to_train_test_set(0.9, origin, 10)  # deterministic 900/100 per class

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, list(range(rank, len(test_set), world))),
                             batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(ResNet19()).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs, eta_min=0)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best_acc = 0, 0.0
    last_path = os.path.join(args.out, "last.pth")
    if os.path.exists(last_path):
        ckpt = torch.load(last_path)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]
        if rank == 0:
            print(f"resumed from epoch {ckpt['epoch']}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        meter = torch.zeros(3, device=device)
        for frames, target in train_loader:
            x = to_input(frames, args.size, device, train=True)
            target = target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out_t = model(x)
                loss = tet_loss(out_t, target, args.tet_lambda)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            functional.reset_net(model)
            meter += torch.stack([loss.detach().float() * target.numel(),
                                  (out_t.mean(0).argmax(1) == target).sum().float(),
                                  torch.tensor(float(target.numel()), device=device)])
        scheduler.step()

        model.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            for frames, target in test_loader:
                x = to_input(frames, args.size, device, train=False)
                target = target.to(device)
                pred = model.module(x).mean(0).argmax(1)
                functional.reset_net(model)
                hits += torch.stack([(pred == target).sum().float(), torch.tensor(float(target.numel()), device=device)])
        dist.all_reduce(meter)
        dist.all_reduce(hits)
        test_acc = (hits[0] / hits[1]).item()

        if rank == 0:
            best_acc = max(best_acc, test_acc)
            print(f"ep {epoch:3d} loss {meter[0] / meter[2]:.4f} train {meter[1] / meter[2]:.4f} "
                  f"test {test_acc:.4f} best {best_acc:.4f} lr {scheduler.get_last_lr()[0]:.4f} "
                  f"{time.time() - tic:.0f}s", flush=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch, "best_acc": best_acc}
            torch.save(state, last_path + ".tmp")
            os.replace(last_path + ".tmp", last_path)
            if test_acc >= best_acc:
                torch.save(state, os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
