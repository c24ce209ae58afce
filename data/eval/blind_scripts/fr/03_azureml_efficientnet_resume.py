"""
Defect classification (EfficientNet-B3) on Azure ML.

job.yml (excerpt):
    command: >-
      python train.py --data ${{inputs.images}} --ckpt-dir ${{outputs.checkpoints}}
      --epochs 40 --batch-size 48
    distribution:
      type: pytorch
      process_count_per_instance: 4
    resources:
      instance_count: 2      # Standard_NC24ads_A100_v4 x2

Azure ML starts one process per GPU and exports MASTER_ADDR, MASTER_PORT,
WORLD_SIZE, RANK, LOCAL_RANK and NODE_RANK. The checkpoints output is a
read-write mount of a blob container, so a preempted job resumes from it.
"""
import argparse
import glob
import os
import re
import time

import mlflow
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.datasets import ImageFolder


def parse():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=str, required=True)
    parser.add_argument("--ckpt-dir", type=str, required=True)
    parser.add_argument("--model", type=str, default="efficientnet_b3")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--img-size", type=int, default=300)
    parser.add_argument("--num-workers", type=int, default=6)
    parser.add_argument("--keep-last", type=int, default=3)
    return parser.parse_args()


def transforms_for(img_size):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train = transforms.Compose([
        transforms.RandomResizedCrop(img_size, scale=(0.5, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.RandomVerticalFlip(),
        transforms.ColorJitter(0.2, 0.2, 0.1),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    evaluate = transforms.Compose([
        transforms.Resize(int(img_size * 1.14)),
        transforms.CenterCrop(img_size),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    return train, evaluate


def latest_checkpoint(ckpt_dir):
    files = glob.glob(os.path.join(ckpt_dir, "epoch_*.pt"))
    if not files:
        return None
    return max(files, key=lambda f: int(re.search(r"epoch_(\d+)\.pt", f).group(1)))


def prune_checkpoints(ckpt_dir, keep):
    files = sorted(glob.glob(os.path.join(ckpt_dir, "epoch_*.pt")),
                   key=lambda f: int(re.search(r"epoch_(\d+)\.pt", f).group(1)))
    for f in files[:-keep]:
        os.remove(f)


def run_epoch(model, loader, criterion, optimizer, scheduler, scaler, device, train=True):
    model.train(train)
    totals = torch.zeros(3, device=device)
    ctx = torch.enable_grad() if train else torch.no_grad()
    with ctx:
        for x, y in loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                out = model(x)
                loss = criterion(out, y)
            if train:
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
            totals[0] += loss.detach() * y.size(0)
            totals[1] += (out.argmax(1) == y).sum()
            totals[2] += y.size(0)
    dist.all_reduce(totals)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(17)

    train_tf, eval_tf = transforms_for(args.img_size)
    train_ds = ImageFolder(os.path.join(args.data, "train"), transform=train_tf)
    val_ds = ImageFolder(os.path.join(args.data, "val"), transform=eval_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size * 2, sampler=val_sampler,
                        num_workers=args.num_workers, pin_memory=True)

    model = timm.create_model(args.model, pretrained=True, num_classes=len(train_ds.classes))
    model = model.to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])

    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world_size / 8,
                                  weight_decay=args.weight_decay)
    steps_total = args.epochs * len(train_dl)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr * world_size / 8,
                                                    total_steps=steps_total, pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler(enabled=False)  # bf16 does not need loss scaling

    start_epoch, best_acc = 0, 0.0
    resume_from = latest_checkpoint(args.ckpt_dir)
    if resume_from is not None:
        checkpoint = torch.load(resume_from)
        model.module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        start_epoch = checkpoint["epoch"] + 1
        best_acc = checkpoint.get("best_acc", 0.0)
        if rank == 0:
            print(f"resumed from {resume_from} at epoch {start_epoch}", flush=True)
    dist.barrier()

    if rank == 0:
        mlflow.log_params({"model": args.model, "world_size": world_size,
                           "batch_size": args.batch_size, "lr": args.lr})

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        tic = time.time()
        train_loss, train_acc = run_epoch(model, train_dl, criterion, optimizer, scheduler,
                                          scaler, device, train=True)
        val_loss, val_acc = run_epoch(model, val_dl, criterion, optimizer, scheduler,
                                      scaler, device, train=False)
        if rank == 0:
            mlflow.log_metrics({"train_loss": train_loss, "train_acc": train_acc,
                                "val_loss": val_loss, "val_acc": val_acc,
                                "epoch_time": time.time() - tic}, step=epoch)
            print(f"[{epoch}] train {train_loss:.4f}/{train_acc:.3f} "
                  f"val {val_loss:.4f}/{val_acc:.3f}", flush=True)
            best_acc = max(best_acc, val_acc)
            os.makedirs(args.ckpt_dir, exist_ok=True)
            path = os.path.join(args.ckpt_dir, f"epoch_{epoch}.pt")
            torch.save({
                "epoch": epoch,
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "best_acc": best_acc,
            }, path + ".tmp")
            os.replace(path + ".tmp", path)
            prune_checkpoints(args.ckpt_dir, args.keep_last)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
