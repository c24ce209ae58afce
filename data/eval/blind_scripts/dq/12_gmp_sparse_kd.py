"""Gradual magnitude pruning (Zhu & Gupta cubic schedule) of a ResNet-50 to 80%
unstructured sparsity, with the dense ResNet-50 as distillation teacher.

Masks are kept as plain tensors and re-applied to the weights after every
optimizer step, so the sparse checkpoint loads into a vanilla torchvision model.

    torchrun --nproc_per_node=8 12_gmp_sparse_kd.py --data /data/imagenet --final-sparsity 0.8
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
from torchvision import datasets, transforms
from torchvision.models import ResNet50_Weights, resnet50


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--prune-start", type=int, default=2)
    p.add_argument("--prune-end", type=int, default=30)
    p.add_argument("--prune-freq", type=int, default=500, help="iterations between mask updates")
    p.add_argument("--final-sparsity", type=float, default=0.8)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--T", type=float, default=2.0)
    p.add_argument("--kd", type=float, default=0.5)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--out", default="runs/gmp_r50_s80")
    return p.parse_args()


def prunable(model):
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, (nn.Conv2d, nn.Linear)) and n != "conv1"]


def sparsity_at(it, start_it, end_it, final):
    if it < start_it:
        return 0.0
    if it >= end_it:
        return final
    frac = (it - start_it) / (end_it - start_it)
    return final * (1 - (1 - frac) ** 3)


@torch.no_grad()
def update_masks(model, masks, sparsity):
    """Layer-wise magnitude pruning. Weights are identical on every rank, so masks are too."""
    for name, m in prunable(model):
        w = m.weight.detach().abs().flatten()
        k = int(sparsity * w.numel())
        if k == 0:
            continue
        thresh = w.kthvalue(k).values
        masks[name] = (m.weight.abs() > thresh).to(m.weight.dtype)


@torch.no_grad()
def apply_masks(model, masks):
    for name, m in prunable(model):
        if name in masks:
            m.weight.mul_(masks[name])


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    count = torch.zeros(1, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        correct += (model(x).argmax(1) == y).sum()
        count += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(count)
    return (correct / count).item() * 100


def global_sparsity(model):
    zeros = total = 0
    for _, m in prunable(model):
        zeros += (m.weight == 0).sum().item()
        total += m.weight.numel()
    return zeros / total


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_ds = datasets.ImageFolder(f"{args.data}/train", transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    val_ds = datasets.ImageFolder(f"{args.data}/val", transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm]))
    train_sampler = DistributedSampler(train_ds)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world_size)),
                            batch_size=200, num_workers=args.workers, pin_memory=True)

    teacher = resnet50(weights=ResNet50_Weights.IMAGENET1K_V2).to(device).eval()
    teacher.requires_grad_(False)
    student = resnet50(weights=ResNet50_Weights.IMAGENET1K_V2).to(device)
    student = DDP(student, device_ids=[local_rank])
    net = student.module

    lr = args.lr * args.batch_size * world_size / 256
    opt = torch.optim.SGD(student.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    iters = len(train_loader)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * iters)
    start_it, end_it = args.prune_start * iters, args.prune_end * iters
    masks = {}

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    it = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        student.train()
        tic = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if it >= start_it and it <= end_it and (it - start_it) % args.prune_freq == 0:
                update_masks(net, masks, sparsity_at(it, start_it, end_it, args.final_sparsity))
                apply_masks(net, masks)

            with torch.autocast("cuda", dtype=torch.bfloat16):
                with torch.no_grad():
                    t = teacher(x)
                s = student(x)
            s, t = s.float(), t.float()
            loss = (1 - args.kd) * F.cross_entropy(s, y) + args.kd * args.T ** 2 * F.kl_div(
                F.log_softmax(s / args.T, 1), F.softmax(t / args.T, 1), reduction="batchmean")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            apply_masks(net, masks)
            sched.step()
            it += 1
            if rank == 0 and it % 200 == 0:
                print(f"ep {epoch} it {it} loss {loss.item():.3f} "
                      f"target sparsity {sparsity_at(it, start_it, end_it, args.final_sparsity):.3f}",
                      flush=True)

        if rank == 0:
            acc = evaluate(net, val_loader, device)
            sp = global_sparsity(net)
            print(f"epoch {epoch} ({time.time() - tic:.0f}s): top1 {acc:.2f} sparsity {sp:.3f}", flush=True)
            torch.save({"model": net.state_dict(), "masks": masks, "epoch": epoch, "it": it},
                       os.path.join(args.out, "last.pth"))
            if sp >= args.final_sparsity - 1e-3 and acc > best:
                best = acc
                torch.save(net.state_dict(), os.path.join(args.out, "best_sparse.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
