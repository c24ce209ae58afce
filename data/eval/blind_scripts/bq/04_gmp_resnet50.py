"""Gradual magnitude pruning (Zhu & Gupta, 2017) of ResNet-50 on ImageNet.

Sparsity follows the cubic schedule s_t = s_f + (s_i - s_f) * (1 - (t - t0) / (n * dt))^3
between --prune-start and --prune-end epochs; the masks are global over all conv / fc
weights except the stem. Weights are kept masked after every optimizer step.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
        04_gmp_resnet50.py --data /mnt/shared/imagenet --output /mnt/shared/runs/gmp90
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--base-lr", type=float, default=0.1, help="per 256 images")
    ap.add_argument("--wd", type=float, default=1e-4)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--final-sparsity", type=float, default=0.9)
    ap.add_argument("--init-sparsity", type=float, default=0.05)
    ap.add_argument("--prune-start", type=int, default=5)
    ap.add_argument("--prune-end", type=int, default=60)
    ap.add_argument("--prune-every", type=int, default=2000, help="iterations between mask updates")
    ap.add_argument("--label-smoothing", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


def prunable_weights(model):
    out = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)) and name != "conv1":
            out.append((name, m.weight))
    return out


def target_sparsity(it, start_it, end_it, s_i, s_f):
    if it < start_it:
        return 0.0
    if it >= end_it:
        return s_f
    frac = (it - start_it) / (end_it - start_it)
    return s_f + (s_i - s_f) * (1.0 - frac) ** 3


@torch.no_grad()
def compute_masks(weights, sparsity):
    """Global magnitude masks. Weights are identical on every rank after the DDP step,
    so every rank arrives at the same masks without communication."""
    scores = torch.cat([w.detach().abs().flatten() for _, w in weights])
    k = int(sparsity * scores.numel())
    if k < 1:
        return {name: torch.ones_like(w, dtype=torch.bool) for name, w in weights}
    threshold = torch.kthvalue(scores.float().cpu(), k).values.to(scores.device)
    return {name: w.detach().abs() > threshold for name, w in weights}


@torch.no_grad()
def apply_masks(weights, masks):
    for name, w in weights:
        w.mul_(masks[name])


def sparsity_report(weights, masks):
    total = sum(m.numel() for m in masks.values())
    zeros = sum((~m).sum().item() for m in masks.values())
    return zeros / max(total, 1)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        acc[0] += (logits.argmax(1) == y).sum()
        acc[1] += (logits.topk(5, 1).indices == y[:, None]).any(1).sum()
        acc[2] += y.numel()
    dist.all_reduce(acc)
    return (100 * acc[0] / acc[2]).item(), (100 * acc[1] / acc[2]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_set = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "train"),
        T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    val_set = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "val"),
        T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True, prefetch_factor=4)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=128,
                            num_workers=args.workers, pin_memory=True)

    model = torchvision.models.resnet50(weights="IMAGENET1K_V2").to(device)
    model = model.to(memory_format=torch.channels_last)
    ddp = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    weights = prunable_weights(model)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    lr = args.base_lr * args.batch_size * world / 256
    opt = torch.optim.SGD([{"params": decay, "weight_decay": args.wd},
                           {"params": no_decay, "weight_decay": 0.0}],
                          lr=lr, momentum=0.9, nesterov=True)
    iters_per_epoch = len(train_loader)
    total_iters = args.epochs * iters_per_epoch
    warmup_iters = args.warmup_epochs * iters_per_epoch

    def lr_at(it):
        if it < warmup_iters:
            return lr * (it + 1) / warmup_iters
        return 0.5 * lr * (1 + math.cos(math.pi * (it - warmup_iters) / (total_iters - warmup_iters)))

    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    masks = {name: torch.ones_like(w, dtype=torch.bool) for name, w in weights}
    start_epoch = 0
    ckpt_path = os.path.join(args.output, "checkpoint.pt")
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        masks = {k: v.to(device) for k, v in ckpt["masks"].items()}
        start_epoch = ckpt["epoch"] + 1

    prune_start_it = args.prune_start * iters_per_epoch
    prune_end_it = args.prune_end * iters_per_epoch
    it = start_epoch * iters_per_epoch
    if is_main:
        os.makedirs(args.output, exist_ok=True)
        print(f"world {world}, lr {lr:.3f}, {iters_per_epoch} it/epoch, target sparsity {args.final_sparsity}")

    for epoch in range(start_epoch, args.epochs):
        ddp.train()
        t0 = time.time()
        for x, y in train_loader:
            for g in opt.param_groups:
                g["lr"] = lr_at(it)
            if prune_start_it <= it <= prune_end_it and (it - prune_start_it) % args.prune_every == 0:
                s = target_sparsity(it, prune_start_it, prune_end_it, args.init_sparsity, args.final_sparsity)
                masks = compute_masks(weights, s)
                apply_masks(weights, masks)

            x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            apply_masks(weights, masks)
            it += 1

            if is_main and it % 200 == 0:
                print(f"ep {epoch} it {it} loss {loss.item():.3f} lr {opt.param_groups[0]['lr']:.4f} "
                      f"sparsity {sparsity_report(weights, masks):.3f}")

        top1, top5 = evaluate(ddp, val_loader, device)
        if is_main:
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s: top1 {top1:.2f} top5 {top5:.2f} "
                  f"sparsity {sparsity_report(weights, masks):.3f}")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "masks": {k: v.cpu() for k, v in masks.items()}, "epoch": epoch},
                       ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    if is_main:
        final = {k: v.half() for k, v in model.state_dict().items()}
        torch.save(final, os.path.join(args.output, f"resnet50_sparse{int(100 * args.final_sparsity)}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
