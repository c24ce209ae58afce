"""
Hierarchical post-local SGD for ConvNeXt-T on Food-101.

For the first `--localsgd-start` iterations DDP all-reduces gradients over all
GPUs. After that, gradients are only all-reduced inside each node (cheap,
NVLink) and the parameters are averaged across nodes every `--period` steps
by PeriodicModelAverager (slow cross-node link used 1/period as often).

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        19_post_localsgd_convnext.py --data /shared/food-101 --out /shared/runs/food_localsgd
"""
import argparse
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.distributed.algorithms.model_averaging.averagers as averagers
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=4e-3, help="for global batch 4096")
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--period", type=int, default=8)
    ap.add_argument("--localsgd-start", type=int, default=1000)
    ap.add_argument("--pretrained", action="store_true")
    return ap.parse_args()


def build_data(root, bs):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.3, 0.3, 0.3), transforms.ToTensor(), transforms.Normalize(mean, std)])
    test_tf = transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), transforms.Normalize(mean, std)])
    train = datasets.Food101(root, split="train", transform=train_tf, download=False)
    test = datasets.Food101(root, split="test", transform=test_tf, download=False)
    train_sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    test_sampler = DistributedSampler(test, shuffle=False)
    train_dl = DataLoader(train, batch_size=bs, sampler=train_sampler, num_workers=8, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    test_dl = DataLoader(test, batch_size=128, sampler=test_sampler, num_workers=8, pin_memory=True)
    return train_dl, test_dl, train_sampler


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    train_dl, test_dl, train_sampler = build_data(args.data, args.batch_size)

    model = timm.create_model("convnext_tiny", pretrained=args.pretrained, num_classes=101,
                              drop_path_rate=0.1).to(device)
    model = DDP(model, device_ids=[local_rank])
    # subgroup=None -> one subgroup per node (intra-node all-reduce after the switch)
    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=args.localsgd_start)
    model.register_comm_hook(state, post_localSGD_hook)

    lr = args.lr * args.batch_size * world / 4096
    local_opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.wd)
    optimizer = PostLocalSGDOptimizer(
        optim=local_opt,
        averager=averagers.PeriodicModelAverager(period=args.period, warmup_steps=args.localsgd_start),
    )
    total = args.epochs * len(train_dl)
    warmup = 2 * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        local_opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup))))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world}, lr {lr:.2e}, averaging every {args.period} steps after {args.localsgd_start}")

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sched.step()
            if rank == 0 and i % 50 == 0:
                print(f"ep {epoch} it {i}/{len(train_dl)} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}")

        model.eval()
        correct, count, val_loss = 0, 0, 0.0
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for x, y in test_dl:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits = model(x)
                val_loss += F.cross_entropy(logits.float(), y, reduction="sum").item()
                correct += (logits.argmax(1) == y).sum().item()
                count += y.numel()
        acc = correct / count
        if rank == 0:
            print(f"epoch {epoch}: test_loss {val_loss / count:.4f} test_acc {acc:.4f} ({time.time() - t0:.0f}s)")
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": epoch, "acc": acc}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if acc > best_acc:
                best_acc = acc
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
        dist.barrier()

    if rank == 0:
        print(f"best test acc {best_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
