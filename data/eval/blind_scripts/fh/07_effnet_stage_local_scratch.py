#!/usr/bin/env python
"""EfficientNet-B3 on a plant-disease image set (~600k JPEGs).

The dataset lives as a single tarball on the parallel file system; reading
600k small files from GPFS is slow, so every node unpacks it once into its
local NVMe ($LOCAL_SCRATCH) at job start.

    #SBATCH -N 4
    #SBATCH --ntasks-per-node=4
    #SBATCH --gres=gpu:a100:4
    #SBATCH --cpus-per-task=16
    #SBATCH --tmp=400G

    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_PORT=29700
    srun python effnet_train.py --tar /gpfs/data/plants/plants_v3.tar \
        --out /gpfs/projects/agri/effnet_b3
"""
import argparse
import os
import tarfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import timm
from timm.data import create_transform
from timm.utils import ModelEmaV2
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.datasets import ImageFolder


def args_():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tar", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="efficientnet_b3")
    ap.add_argument("--img-size", type=int, default=300)
    ap.add_argument("--bs", type=int, default=48, help="per-GPU batch")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=0.016, help="for global batch 256")
    ap.add_argument("--ema", type=float, default=0.9998)
    return ap.parse_args()


def stage_dataset(tar_path, local_rank):
    scratch = os.environ.get("LOCAL_SCRATCH", "/tmp")
    target = os.path.join(scratch, os.path.basename(tar_path).replace(".tar", ""))
    if local_rank == 0:
        if not os.path.isdir(target):
            t0 = time.time()
            print(f"[{os.uname().nodename}] extracting {tar_path} -> {scratch}", flush=True)
            with tarfile.open(tar_path) as tf:
                tf.extractall(scratch)
            print(f"[{os.uname().nodename}] done in {time.time() - t0:.0f}s", flush=True)
    else:
        while not os.path.isdir(target):
            time.sleep(10)
    return target


def main():
    args = args_()
    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])

    data_root = stage_dataset(args.tar, local_rank)

    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world)
    device = torch.device("cuda", local_rank)

    train_set = ImageFolder(os.path.join(data_root, "train"),
                            create_transform(args.img_size, is_training=True,
                                             auto_augment="rand-m9-mstd0.5"))
    val_set = ImageFolder(os.path.join(data_root, "val"),
                          create_transform(args.img_size, is_training=False))
    n_classes = len(train_set.classes)

    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    workers = int(os.environ.get("SLURM_CPUS_PER_TASK", 8))
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=sampler, num_workers=workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=128, num_workers=workers, pin_memory=True)

    model = timm.create_model(args.model, pretrained=False, num_classes=n_classes,
                              drop_rate=0.3, drop_path_rate=0.2).to(device)
    model = DDP(model, device_ids=[local_rank])
    ema = ModelEmaV2(model.module, decay=args.ema)

    lr = args.lr * args.bs * world / 256
    optimizer = timm.optim.create_optimizer_v2(model.module, "rmsproptf", lr=lr, weight_decay=1e-5,
                                               eps=1e-3, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, pct_start=0.05,
                                                total_steps=args.epochs * len(train_loader))
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    ckpt = os.path.join(args.out, "last.pth")
    start = 0
    if os.path.exists(ckpt):
        st = torch.load(ckpt, map_location="cpu")
        model.module.load_state_dict(st["model"])
        ema.module.load_state_dict(st["ema"])
        optimizer.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["sched"])
        start = st["epoch"] + 1

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sched.step()
            ema.update(model.module)
            loss_sum += torch.stack([loss.detach().float(), torch.ones((), device=device)])

        ema.module.eval()
        correct = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                correct[0] += (ema.module(x).argmax(1) == y).sum()
                correct[1] += y.numel()
        dist.all_reduce(correct)
        dist.all_reduce(loss_sum)

        if rank == 0:
            acc = (correct[0] / correct[1]).item()
            tr_loss = (loss_sum[0] / loss_sum[1]).item()
            print(f"epoch {epoch}: train loss {tr_loss:.4f}  ema val acc {acc:.4f}", flush=True)
            writer.add_scalar("train/loss", tr_loss, epoch)
            writer.add_scalar("val/ema_acc", acc, epoch)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "ema": ema.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ckpt)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
