"""
Gradual magnitude pruning (Zhu & Gupta 2017) of MobileNetV2 on ImageNet with
per-layer binary masks, re-applied after every optimizer step. At the end of
each pruning stage the sparse model is evaluated for accuracy (all GPUs) and for
single-thread CPU latency (rank 0).

    torchrun --nproc_per_node=4 gmp_mbv2.py --data /data/imagenet --final-sparsity 0.75
"""
import argparse
import copy
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--pretrained", default="IMAGENET1K_V2")
    ap.add_argument("--final-sparsity", type=float, default=0.75)
    ap.add_argument("--prune-start", type=int, default=1, help="epoch")
    ap.add_argument("--prune-end", type=int, default=20, help="epoch")
    ap.add_argument("--prune-every", type=int, default=500, help="steps")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="/nfs/exp/gmp_mbv2")
    return ap.parse_args()


def prunable(model):
    # conv / linear weights except depthwise convs and the stem
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d) and m.groups == 1 and m.in_channels > 3:
            out[name + ".weight"] = m.weight
        elif isinstance(m, nn.Linear):
            out[name + ".weight"] = m.weight
    return out


def sparsity_at(step, start, end, final, s0=0.0):
    if step < start:
        return s0
    if step >= end:
        return final
    frac = (step - start) / (end - start)
    return final + (s0 - final) * (1.0 - frac) ** 3


@torch.no_grad()
def update_masks(params, masks, target):
    for name, w in params.items():
        k = int(target * w.numel())
        if k == 0:
            continue
        thresh = w.abs().flatten().kthvalue(k).values
        masks[name] = (w.abs() > thresh).to(w.dtype)


@torch.no_grad()
def apply_masks(params, masks):
    for name, w in params.items():
        if name in masks:
            w.mul_(masks[name])


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    t = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        t[0] += (model(x).argmax(1) == y).sum()
        t[1] += y.numel()
    dist.all_reduce(t)
    return (100 * t[0] / t[1]).item()


@torch.no_grad()
def cpu_latency_ms(module, runs=50):
    m = copy.deepcopy(module).cpu().eval()
    torch.set_num_threads(1)
    x = torch.randn(1, 3, 224, 224)
    for _ in range(10):
        m(x)
    t0 = time.perf_counter()
    for _ in range(runs):
        m(x)
    return (time.perf_counter() - t0) / runs * 1e3


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_ds = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "train"),
        T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    val_ds = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "val"),
        T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    train_sampler = DistributedSampler(train_ds)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, 200, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    model = torchvision.models.mobilenet_v2(weights=args.pretrained).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    params = prunable(model)
    masks = {}

    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9, weight_decay=4e-5)
    steps_per_epoch = len(train_loader)
    total_steps = args.epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, total_steps)
    p_start, p_end = args.prune_start * steps_per_epoch, args.prune_end * steps_per_epoch

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(params)} prunable tensors, {steps_per_epoch} steps/epoch", flush=True)

    step = 0
    history = []
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        ddp.train()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(ddp(x), y, label_smoothing=0.1)
            if not torch.isfinite(loss):
                print(f"[rank {rank}] non-finite loss at step {step}, skipping batch", flush=True)
                continue
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if p_start <= step <= p_end and step % args.prune_every == 0:
                update_masks(params, masks, sparsity_at(step, p_start, p_end, args.final_sparsity))
            apply_masks(params, masks)
            step += 1
            if rank == 0 and step % 200 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.3f}", flush=True)

        top1 = evaluate(ddp, val_loader, device)
        if rank == 0:
            zeros = sum(int((w == 0).sum()) for w in params.values())
            total = sum(w.numel() for w in params.values())
            lat = cpu_latency_ms(model)
            rec = {"epoch": epoch, "top1": top1, "sparsity": zeros / total, "cpu_ms": lat}
            history.append(rec)
            print(json.dumps(rec), flush=True)
            torch.save({"model": model.state_dict(),
                        "masks": {k: v.cpu() for k, v in masks.items()},
                        "step": step, "epoch": epoch},
                       os.path.join(args.out, f"ckpt_ep{epoch:03d}.pth"))
        dist.barrier()

    if rank == 0:
        with open(os.path.join(args.out, "history.json"), "w") as f:
            json.dump(history, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
