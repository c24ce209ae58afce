"""ResNet-50 on ImageNet-100 with label smoothing + mixup, single node, launched with mp.spawn.

    python 19_imagenet100_spawn.py --cfg configs/in100_r50_ls.yaml
"""
import argparse
import os
import socket
import time
from contextlib import closing

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms


def free_port():
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class SoftTargetCE(nn.Module):
    def forward(self, logits, target):
        return torch.sum(-target * F.log_softmax(logits, dim=-1), dim=-1).mean()


def one_hot_smooth(y, num_classes, smoothing):
    off = smoothing / num_classes
    on = 1.0 - smoothing + off
    return torch.full((y.size(0), num_classes), off, device=y.device).scatter_(1, y.unsqueeze(1), on)


def mixup(x, y_soft, alpha):
    if alpha <= 0:
        return x, y_soft
    lam = float(np.random.beta(alpha, alpha))
    idx = torch.randperm(x.size(0), device=x.device)
    return lam * x + (1 - lam) * x[idx], lam * y_soft + (1 - lam) * y_soft[idx]


def build_loaders(cfg, rank, world_size):
    normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_set = torchvision.datasets.ImageFolder(
        os.path.join(cfg["data"], "train"),
        transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                            transforms.ColorJitter(0.4, 0.4, 0.4), transforms.ToTensor(), normalize]))
    val_set = torchvision.datasets.ImageFolder(
        os.path.join(cfg["data"], "val"),
        transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(),
                            normalize]))
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)),
                            batch_size=200, num_workers=cfg["workers"], pin_memory=True)
    return train_loader, val_loader, sampler


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    acc = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = net(x)
        top5 = out.topk(5, 1).indices
        acc[0] += (top5[:, 0] == y).sum()
        acc[1] += (top5 == y[:, None]).any(1).sum()
        acc[2] += y.numel()
    dist.all_reduce(acc)
    return (100 * acc[0] / acc[2]).item(), (100 * acc[1] / acc[2]).item()


def main_worker(cfg, rank, world_size):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    np.random.seed(cfg["seed"] + rank)
    torch.manual_seed(cfg["seed"])

    train_loader, val_loader, sampler = build_loaders(cfg, rank, world_size)
    net = torchvision.models.resnet50(num_classes=100)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[rank])

    lr = cfg["lr"] * cfg["batch_size"] * world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=cfg["wd"],
                                nesterov=True)
    warmup = cfg["warmup_epochs"] * len(train_loader)
    total = cfg["epochs"] * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + np.cos(np.pi * (s - warmup) / (total - warmup))))
    scaler = torch.cuda.amp.GradScaler()
    criterion = SoftTargetCE()

    writer = SummaryWriter(cfg["out"]) if rank == 0 else None
    best = 0.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, target = mixup(x, one_hot_smooth(y, 100, cfg["smoothing"]), cfg["mixup"])
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(x), target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if rank == 0 and i % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), epoch * len(train_loader) + i)

        top1, top5 = validate(net, val_loader, device)
        if rank == 0:
            writer.add_scalar("val/top1", top1, epoch)
            writer.add_scalar("val/top5", top5, epoch)
            print(f"epoch {epoch}: top1 {top1:.2f} top5 {top5:.2f} ({time.time() - t0:.0f}s)", flush=True)
            ckpt = {"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(), "epoch": epoch, "top1": top1}
            torch.save(ckpt, os.path.join(cfg["out"], "last.pth"))
            if top1 > best:
                best = top1
                torch.save(ckpt, os.path.join(cfg["out"], "best.pth"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    ap.add_argument("--gpus", type=int, default=None)
    a = ap.parse_args()
    with open(a.cfg) as f:
        cfg = yaml.safe_load(f)
    os.makedirs(cfg["out"], exist_ok=True)

    world_size = a.gpus or torch.cuda.device_count()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(main_worker, args=(cfg, world_size), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
