#!/usr/bin/env python3
"""ResNet-50 training from webdataset tar shards on local NVMe.

Launch:  torchrun --nproc_per_node=8 09_wds_resnet_shards.py --shards /nvme/in1k-wds
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
import torchvision.transforms as T
import webdataset as wds
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--shards", required=True, help="dir with train-*.tar and val-*.tar")
    p.add_argument("--n-train-shards", type=int, default=640)
    p.add_argument("--n-val-shards", type=int, default=64)
    p.add_argument("--train-size", type=int, default=1281167)
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--bs", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--ckpt", default="/checkpoint/rn50_wds/state.pt")
    p.add_argument("--wandb-project", default="wds-rn50")
    return p.parse_args()


def shard_urls(root, prefix, n):
    return [os.path.join(root, f"{prefix}-{i:06d}.tar") for i in range(n)]


def train_dataset(urls, bs):
    tf = T.Compose([
        T.RandomResizedCrop(224),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        T.Normalize(MEAN, STD),
    ])
    return (
        wds.WebDataset(urls, shardshuffle=100, nodesplitter=wds.split_by_node, handler=wds.warn_and_continue)
        .shuffle(2000)
        .decode("pil")
        .to_tuple("jpg", "cls")
        .map_tuple(tf, lambda y: y)
        .batched(bs, partial=False)
    )


def val_dataset(urls, bs):
    tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(MEAN, STD)])
    return (
        wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node)
        .decode("pil")
        .to_tuple("jpg", "cls")
        .map_tuple(tf, lambda y: y)
        .batched(bs, partial=True)
    )


def lr_for(epoch_float, base, warm=5, total=90):
    if epoch_float < warm:
        return base * epoch_float / warm
    return base * 0.5 * (1 + math.cos(math.pi * (epoch_float - warm) / (total - warm)))


@torch.no_grad()
def run_validation(net, loader, device):
    net.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for x, y in loader:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        out = net(x)
        loss_sum += nn.functional.cross_entropy(out, y, reduction="sum").item()
        correct += (out.argmax(1) == y).sum().item()
        total += y.size(0)
    stats = torch.tensor([correct, total, loss_sum], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    correct, total, loss_sum = stats.tolist()
    return correct / total * 100, loss_sum / total


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    steps_per_epoch = args.train_size // (args.bs * world)
    train_loader = (
        wds.WebLoader(train_dataset(shard_urls(args.shards, "train", args.n_train_shards), args.bs),
                      batch_size=None, num_workers=args.workers, pin_memory=True, persistent_workers=True)
        .repeat()
        .with_epoch(steps_per_epoch)
    )
    val_loader = wds.WebLoader(val_dataset(shard_urls(args.shards, "val", args.n_val_shards), 250),
                               batch_size=None, num_workers=4, pin_memory=True)

    model = torchvision.models.resnet50(zero_init_residual=True).to(device, memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)

    base_lr = args.lr * args.bs * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=0.9, weight_decay=args.wd)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss()

    start_epoch = 0
    if os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, map_location=device)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["opt"])
        scaler.load_state_dict(state["scaler"])
        start_epoch = state["epoch"] + 1

    if rank == 0:
        wandb.init(project=args.wandb_project, config=vars(args), resume="allow")

    for epoch in range(start_epoch, args.epochs):
        model.train()
        tic = time.time()
        for i, (x, y) in enumerate(train_loader):
            lr = lr_for(epoch + i / steps_per_epoch, base_lr, total=args.epochs)
            for g in optimizer.param_groups:
                g["lr"] = lr
            x = x.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if i % 100 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/loss": l.item(), "lr": lr}, step=epoch * steps_per_epoch + i)

        top1, vloss = run_validation(model.module, val_loader, device)
        if rank == 0:
            elapsed = time.time() - tic
            print(f"epoch {epoch}: top1 {top1:.2f} val_loss {vloss:.3f} {elapsed:.0f}s")
            wandb.log({"val/top1": top1, "val/loss": vloss, "epoch": epoch},
                      step=(epoch + 1) * steps_per_epoch)
            os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch}, args.ckpt)
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
