"""2:4 semi-structured sparse fine-tuning of ViT-B/16 (timm) on ImageNet.

All nn.Linear layers inside the transformer blocks get an N:M (2 of every 4 along the
input dim) magnitude mask. Masks are recomputed every --mask-update steps during the
first epochs and then frozen, so the final weights can be handed to
torch.sparse.to_sparse_semi_structured / TensorRT sparse kernels.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
        11_nm_sparse_vit.py --data /lustre/imagenet --ckpt-dir /lustre/$USER/vit_b_2of4
"""
import argparse
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.data import create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.data.mixup import Mixup
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--model", default="vit_base_patch16_224.augreg_in21k_ft_in1k")
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--m", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--mask-epochs", type=int, default=10, help="masks are frozen after this epoch")
    ap.add_argument("--mask-update", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4, help="for global batch 1024")
    ap.add_argument("--workers", type=int, default=10)
    return ap.parse_args()


def sparse_linears(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("blocks.")]


@torch.no_grad()
def nm_mask(weight, n, m):
    out_f, in_f = weight.shape
    groups = weight.abs().reshape(out_f, in_f // m, m)
    idx = groups.topk(n, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, idx, True)
    return mask.reshape(out_f, in_f)


@torch.no_grad()
def update_masks(layers, n, m):
    return {name: nm_mask(mod.weight, n, m) for name, mod in layers}


@torch.no_grad()
def apply_masks(layers, masks):
    for name, mod in layers:
        mod.weight.mul_(masks[name])


def save_checkpoint(path, model, optimizer, masks, epoch, step, best):
    torch.save({
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "masks": {k: v.cpu() for k, v in masks.items()},
        "epoch": epoch,
        "step": step,
        "best": best,
    }, path)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x).argmax(-1)
        acc += torch.stack([(pred == y).sum(), torch.tensor(y.numel(), device=device)]).float()
    dist.all_reduce(acc)
    return (100 * acc[0] / acc[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    os.makedirs(args.ckpt_dir, exist_ok=True)

    model = timm.create_model(args.model, pretrained=True, drop_path_rate=0.1).to(device)
    cfg = model.pretrained_cfg
    layers = sparse_linears(model)
    ddp_model = DDP(model, device_ids=[local_rank])

    train_tf = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                mean=cfg["mean"], std=cfg["std"])
    val_tf = create_transform(224, is_training=False, crop_pct=cfg.get("crop_pct", 0.9),
                              mean=cfg["mean"], std=cfg["std"])
    train_set = ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = ImageFolder(os.path.join(args.data, "val"), val_tf)
    sampler = DistributedSampler(train_set, shuffle=True)
    train_dl = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=128,
                        num_workers=args.workers, pin_memory=True)

    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    criterion = SoftTargetCrossEntropy()
    lr = args.lr * args.batch_size * world / 1024
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    steps_per_epoch = len(train_dl)
    total_steps = args.epochs * steps_per_epoch

    masks = update_masks(layers, args.n, args.m)
    apply_masks(layers, masks)
    start_epoch, step, best = 0, 0, 0.0
    last = os.path.join(args.ckpt_dir, "last.pt")
    if os.path.exists(last):
        ck = torch.load(last, map_location="cpu")
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        masks = {k: v.to(device) for k, v in ck["masks"].items()}
        start_epoch, step, best = ck["epoch"] + 1, ck["step"], ck["best"]

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        t0 = time.time()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            for g in optimizer.param_groups:
                g["lr"] = 0.5 * lr * (1 + math.cos(math.pi * step / total_steps))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(ddp_model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            if epoch < args.mask_epochs and step % args.mask_update == 0:
                masks = update_masks(layers, args.n, args.m)
            apply_masks(layers, masks)
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step}/{total_steps} loss {loss.item():.4f} "
                      f"{(time.time() - t0) / 60:.1f} min")

        top1 = evaluate(ddp_model, val_dl, device)
        best = max(best, top1)
        if rank == 0:
            print(f"epoch {epoch}: top1 {top1:.2f} (best {best:.2f}), masks {'frozen' if epoch >= args.mask_epochs else 'updating'}")
        save_checkpoint(last, model, optimizer, masks, epoch, step, best)
        if top1 >= best:
            save_checkpoint(os.path.join(args.ckpt_dir, "best.pt"), model, optimizer, masks, epoch, step, best)
        dist.barrier()

    if rank == 0:
        torch.save({k: v.half() for k, v in model.state_dict().items()},
                   os.path.join(args.ckpt_dir, f"vit_b16_{args.n}of{args.m}_fp16.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
