#!/usr/bin/env python3
"""Single-node CIFAR-10 / ResNet-18 trainer with a built-in launcher.

    python 01_spawn_cifar_resnet.py --gpus 4 --epochs 60 --out runs/r18_cifar

The launcher spawns one worker per GPU with torch.multiprocessing and, when a
worker dies, restarts the whole group from the last checkpoint (up to
--max-restarts times). Every worker writes its own log file under <out>/logs.
"""
import argparse
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass, asdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class Config:
    data_dir: str = "./data"
    out: str = "runs/r18_cifar"
    gpus: int = 0
    epochs: int = 60
    batch_size: int = 128          # per GPU
    base_lr: float = 0.1           # for a global batch of 256
    momentum: float = 0.9
    weight_decay: float = 5e-4
    warmup_epochs: int = 2
    workers: int = 4
    seed: int = 0
    max_restarts: int = 2
    amp: bool = True


def parse_args() -> Config:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Config()
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=value)
        else:
            p.add_argument(flag, dest=name, type=type(value), default=value)
    return Config(**vars(p.parse_args()))


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def setup_logging(out_dir: str, rank: int) -> logging.Logger:
    log_dir = os.path.join(out_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    logger = logging.getLogger("cifar")
    logger.setLevel(logging.INFO)
    logger.handlers.clear()
    fmt = logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(message)s")
    fh = logging.FileHandler(os.path.join(log_dir, f"worker_{rank}.log"))
    fh.setFormatter(fmt)
    logger.addHandler(fh)
    if rank == 0:
        sh = logging.StreamHandler(sys.stdout)
        sh.setFormatter(fmt)
        logger.addHandler(sh)
    return logger


def build_model(num_classes: int = 10) -> nn.Module:
    model = torchvision.models.resnet18(num_classes=num_classes)
    # CIFAR stem: 3x3 conv, stride 1, no max-pool
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def build_loaders(cfg: Config, rank: int, world_size: int):
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(),
                          T.ToTensor(), T.Normalize(mean, std)])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    train_set = torchvision.datasets.CIFAR10(cfg.data_dir, train=True, transform=train_tf)
    test_set = torchvision.datasets.CIFAR10(cfg.data_dir, train=False, transform=test_tf)

    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=cfg.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler,
                              num_workers=cfg.workers, pin_memory=True, drop_last=True,
                              persistent_workers=cfg.workers > 0)
    # each rank scores a strided slice of the test set; the sums are all-reduced
    shard = Subset(test_set, list(range(rank, len(test_set), world_size)))
    test_loader = DataLoader(shard, batch_size=256, num_workers=cfg.workers, pin_memory=True)
    return train_loader, test_loader, sampler


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device):
    model.eval()
    stats = torch.zeros(3, device=device)
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        logits = model(images)
        stats[0] += F.cross_entropy(logits, labels, reduction="sum")
        stats[1] += (logits.argmax(dim=1) == labels).sum()
        stats[2] += labels.numel()
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def save_checkpoint(path, model, optimizer, scheduler, scaler, epoch, best_acc):
    tmp = path + ".tmp"
    torch.save({
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": epoch,
        "best_acc": best_acc,
    }, tmp)
    os.replace(tmp, path)


def worker(local_rank: int, cfg: Config, world_size: int, port: int):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    rank = local_rank  # single node
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)

    log = setup_logging(cfg.out, rank)
    torch.manual_seed(cfg.seed)
    torch.backends.cudnn.benchmark = True

    train_loader, test_loader, sampler = build_loaders(cfg, rank, world_size)
    model = build_model()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)

    lr = cfg.base_lr * cfg.batch_size * world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.momentum,
                                weight_decay=cfg.weight_decay, nesterov=True)
    steps_per_epoch = len(train_loader)
    warmup = cfg.warmup_epochs * steps_per_epoch
    total = cfg.epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=warmup),
         torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total - warmup)],
        milestones=[warmup])
    scaler = torch.cuda.amp.GradScaler(enabled=cfg.amp)

    start_epoch, best_acc = 0, 0.0
    ckpt_path = os.path.join(cfg.out, "last.pt")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]
        log.info("resumed from %s at epoch %d", ckpt_path, start_epoch)

    ddp_model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    log.info("world_size=%d lr=%.4f steps/epoch=%d", world_size, lr, steps_per_epoch)

    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for step, (images, labels) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=cfg.amp):
                loss = F.cross_entropy(ddp_model(images), labels, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            running[0] += loss.detach()
            running[1] += 1
            if step % 100 == 0:
                log.info("epoch %d step %d/%d loss %.4f lr %.5f", epoch, step, steps_per_epoch,
                         loss.item(), scheduler.get_last_lr()[0])

        dist.all_reduce(running)
        test_loss, test_acc = evaluate(model, test_loader, device)
        if rank == 0:
            log.info("epoch %d train_loss %.4f test_loss %.4f test_acc %.4f (%.0fs)", epoch,
                     (running[0] / running[1]).item(), test_loss, test_acc, time.time() - t0)
            if test_acc > best_acc:
                best_acc = test_acc
                torch.save(model.state_dict(), os.path.join(cfg.out, "best.pt"))
            save_checkpoint(ckpt_path, model, optimizer, scheduler, scaler, epoch, best_acc)
        dist.barrier()

    log.info("done, best acc %.4f", best_acc)
    dist.destroy_process_group()


def launch(cfg: Config) -> int:
    os.makedirs(cfg.out, exist_ok=True)
    world_size = cfg.gpus or torch.cuda.device_count()
    if world_size < 1:
        print("no GPUs found", file=sys.stderr)
        return 1
    # download once here so the workers never race on the archive
    torchvision.datasets.CIFAR10(cfg.data_dir, train=True, download=True)
    torchvision.datasets.CIFAR10(cfg.data_dir, train=False, download=True)

    for attempt in range(cfg.max_restarts + 1):
        port = find_free_port()
        print(f"[launcher] attempt {attempt}: {world_size} workers on port {port}", flush=True)
        try:
            mp.spawn(worker, args=(world_size, cfg, port), nprocs=world_size, join=True)
            print("[launcher] training finished", flush=True)
            return 0
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            print(f"[launcher] worker failure: {exc}", file=sys.stderr, flush=True)
            time.sleep(10)
    print("[launcher] giving up", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(launch(parse_args()))
