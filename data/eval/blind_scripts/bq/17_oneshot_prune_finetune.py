"""One-shot global L1 unstructured pruning of a pretrained ResNet-50 + sparse fine-tuning.

Uses torch.nn.utils.prune: every conv/fc weight becomes weight_orig (trainable) times
weight_mask (buffer), so pruned entries stay zero through fine-tuning. The masks are
made permanent with prune.remove() before ONNX export.

    torchrun --nproc_per_node=8 17_oneshot_prune_finetune.py --data /datasets/imagenet \
        --amount 0.7 --out runs/r50_sp70
"""
import argparse
import copy
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.utils.prune as prune
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--amount", type=float, default=0.7, help="fraction of prunable weights removed")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=0.01, help="for a global batch of 256")
    p.add_argument("--wd", type=float, default=5e-5)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--resume", default="")
    return p.parse_args()


def prunable_modules(model):
    return [(m, "weight") for n, m in model.named_modules()
            if isinstance(m, (nn.Conv2d, nn.Linear)) and n != "conv1"]


def sparsity(modules):
    zeros = total = 0
    for m, name in modules:
        mask = getattr(m, name + "_mask")
        zeros += (mask == 0).sum().item()
        total += mask.numel()
    return zeros / total


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        top5 = out.topk(5, dim=1).indices
        stats[0] += (top5[:, 0] == y).sum()
        stats[1] += (top5 == y[:, None]).any(dim=1).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats)
    return (100 * stats[0] / stats[2]).item(), (100 * stats[1] / stats[2]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    main_proc = rank == 0
    if main_proc:
        os.makedirs(args.out, exist_ok=True)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), T.Compose([
        T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    val_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), T.Compose([
        T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=125,
                            num_workers=args.workers, pin_memory=True)

    model = torchvision.models.resnet50(weights="IMAGENET1K_V1").to(device)
    modules = prunable_modules(model)
    # same pretrained weights on every rank -> identical global threshold and masks
    prune.global_unstructured(modules, pruning_method=prune.L1Unstructured, amount=args.amount)

    start_epoch = 0
    ckpt = None
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])  # weight_orig / weight_mask keys
        start_epoch = ckpt["epoch"] + 1

    ddp_model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd)
    iters = len(train_loader)
    warmup = iters
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / (args.epochs * iters))))
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    top1, top5 = evaluate(ddp_model, val_loader, device)
    if main_proc:
        print(f"after one-shot pruning ({sparsity(modules):.3f} sparse): top1 {top1:.2f} top5 {top5:.2f}")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        ddp_model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(ddp_model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if main_proc and i % 200 == 0:
                print(f"epoch {epoch} [{i}/{iters}] loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.5f}")

        top1, top5 = evaluate(ddp_model, val_loader, device)
        if main_proc:
            print(f"epoch {epoch}: top1 {top1:.2f} top5 {top5:.2f} ({time.time() - t0:.0f}s)")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "top1": top1},
                       os.path.join(args.out, "checkpoint.pth"))

    if main_proc:
        export = copy.deepcopy(model).cpu().eval()
        for m, name in prunable_modules(export):
            prune.remove(m, name)
        torch.save(export.state_dict(), os.path.join(args.out, f"resnet50_sparse{int(args.amount * 100)}.pth"))
        torch.onnx.export(export, torch.randn(1, 3, 224, 224), os.path.join(args.out, "resnet50_sparse.onnx"),
                          input_names=["input"], output_names=["logits"], opset_version=17,
                          dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})
        print(f"exported, final sparsity {sparsity(modules):.3f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
