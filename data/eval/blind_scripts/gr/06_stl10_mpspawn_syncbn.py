#!/usr/bin/env python3
"""
STL-10 classifier (ResNet-34) trained with DDP started by torch.multiprocessing.spawn,
so it can be run with plain `python` on one machine:

    python 06_stl10_mpspawn_syncbn.py --data ./data --epochs 100

Uses every visible GPU unless --gpus is given.
"""
import argparse
import os
import random
import socket
import time
from contextlib import closing

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms
from tqdm import tqdm

MEAN, STD = (0.4467, 0.4398, 0.4066), (0.2603, 0.2566, 0.2713)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="./data")
    parser.add_argument("--out", default="./ckpt_stl10")
    parser.add_argument("--gpus", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.05, help="for the total batch; not rescaled")
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--resume", action="store_true")
    return parser.parse_args()


def find_free_port():
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("", 0))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return s.getsockname()[1]


def setup(rank, world_size):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


def is_main_process():
    return dist.get_rank() == 0


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def get_transforms():
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(96, scale=(0.35, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.3, 0.3, 0.3, 0.05),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    return train_tf, test_tf


def build_model():
    model = models.resnet34(num_classes=10)
    model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    return model


def run_epoch(model, loader, criterion, optimizer, device, epoch, train=True):
    model.train(train)
    totals = torch.zeros(3, device=device)
    ctx = torch.enable_grad() if train else torch.no_grad()
    with ctx:
        for x, y in tqdm(loader, disable=not is_main_process(), leave=False,
                         desc=f"{'train' if train else 'test'} {epoch}"):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
                loss = criterion(logits, y)
            if train:
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            totals[0] += loss.detach().float() * y.size(0)
            totals[1] += (logits.argmax(1) == y).sum()
            totals[2] += y.size(0)
    dist.all_reduce(totals)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def main_worker(rank, world_size, args):
    setup(rank, world_size)
    device = torch.device("cuda", rank)
    seed_everything(args.seed)

    train_tf, test_tf = get_transforms()
    train_set = datasets.STL10(args.data, split="train", transform=train_tf, download=False)
    test_set = datasets.STL10(args.data, split="test", transform=test_tf, download=False)

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    # test set: strided shard per rank, no padded duplicates
    test_shard = Subset(test_set, range(rank, len(test_set), world_size))
    test_loader = DataLoader(test_shard, batch_size=128, shuffle=False,
                             num_workers=args.workers, pin_memory=True)

    model = build_model()
    # per-GPU batch is only 32, so BN statistics are computed over all GPUs
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[rank])

    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                                weight_decay=5e-4, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    ckpt_path = os.path.join(args.out, "checkpoint.pth")
    start_epoch, best_acc = 0, 0.0
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location={"cuda:0": f"cuda:{rank}"})
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        tr_loss, tr_acc = run_epoch(model, train_loader, criterion, optimizer, device, epoch, True)
        te_loss, te_acc = run_epoch(model.module, test_loader, criterion, optimizer, device, epoch, False)
        scheduler.step()

        if is_main_process():
            print(f"[{epoch:3d}] train {tr_loss:.3f}/{tr_acc:.3f}  test {te_loss:.3f}/{te_acc:.3f}  "
                  f"{time.time() - t0:.0f}s", flush=True)
            best_acc = max(best_acc, te_acc)
            torch.save({"model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "epoch": epoch,
                        "best_acc": best_acc}, ckpt_path)
        dist.barrier()

    cleanup()


def main():
    args = parse_args()
    world_size = args.gpus or torch.cuda.device_count()
    os.makedirs(args.out, exist_ok=True)

    # download once, in the parent, before any worker starts
    datasets.STL10(args.data, split="train", download=True)
    datasets.STL10(args.data, split="test", download=True)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    mp.spawn(main_worker, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
