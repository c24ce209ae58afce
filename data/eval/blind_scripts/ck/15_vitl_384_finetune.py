"""Fine-tune ViT-L/16 (ImageNet-21k weights) on ImageNet-1k at 384px.

Memory: activation checkpointing on every transformer block.
Stability: for the first --head-only-epochs the backbone runs without grad and
only the new classifier is trained, then everything is unfrozen with
layer-wise lr decay.
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint as cp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets

import timm
from timm.data import Mixup, create_transform, resolve_data_config
from timm.loss import SoftTargetCrossEntropy
from timm.utils import ModelEmaV2


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/datasets/imagenet")
    ap.add_argument("--out", default="/checkpoints/vitl16_384_ft")
    ap.add_argument("--model", default="vit_large_patch16_384.augreg_in21k")
    ap.add_argument("--img-size", type=int, default=384)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--head-only-epochs", type=int, default=1)
    ap.add_argument("--warmup-epochs", type=int, default=3)
    ap.add_argument("--blr", type=float, default=2.5e-4, help="lr per 256 images")
    ap.add_argument("--layer-decay", type=float, default=0.75)
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--drop-path", type=float, default=0.3)
    ap.add_argument("--clip-grad", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


class CheckpointedViT(nn.Module):
    def __init__(self, vit):
        super().__init__()
        self.vit = vit
        self.backbone_frozen = False

    def features(self, x):
        v = self.vit
        x = v.patch_embed(x)
        x = v._pos_embed(x)
        x = v.norm_pre(x)
        for blk in v.blocks:
            if torch.is_grad_enabled():
                x = cp.checkpoint(blk, x)
            else:
                x = blk(x)
        return v.norm(x)

    def forward(self, x):
        if self.backbone_frozen:
            with torch.no_grad():
                feats = self.features(x)
        else:
            feats = self.features(x)
        return self.vit.forward_head(feats)


def lrd_groups(vit, base_lr, wd, layer_decay):
    n_layers = len(vit.blocks) + 1
    groups = []
    for name, p in vit.named_parameters():
        if name.startswith(("cls_token", "pos_embed", "patch_embed")):
            lid = 0
        elif name.startswith("blocks."):
            lid = int(name.split(".")[1]) + 1
        else:
            lid = n_layers
        scale = layer_decay ** (n_layers - lid)
        decay = 0.0 if (p.ndim == 1 or name in ("cls_token", "pos_embed")) else wd
        groups.append({"params": [p], "lr": base_lr * scale, "base_lr": base_lr * scale, "weight_decay": decay})
    return groups


def cosine_factor(step, warmup, total):
    if step < warmup:
        return step / max(1, warmup)
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    n_correct = torch.zeros((), device=device)
    n_total = torch.zeros((), device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        n_correct += (out.argmax(1) == y).sum()
        n_total += y.numel()
    dist.all_reduce(n_correct)
    dist.all_reduce(n_total)
    return 100.0 * (n_correct / n_total).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(rank)

    vit = timm.create_model(args.model, pretrained=True, num_classes=1000, drop_path_rate=args.drop_path,
                            img_size=args.img_size)
    data_cfg = resolve_data_config({}, model=vit)
    model = CheckpointedViT(vit).to(device)
    # backbone gets no gradient while it is frozen, so DDP has to look for unused params
    ddp = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    ema = ModelEmaV2(model, decay=0.9999)

    train_tf = create_transform(args.img_size, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                interpolation="bicubic", mean=data_cfg["mean"], std=data_cfg["std"],
                                re_prob=0.25)
    val_tf = create_transform(args.img_size, is_training=False, crop_pct=1.0, interpolation="bicubic",
                              mean=data_cfg["mean"], std=data_cfg["std"])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=64,
                            num_workers=args.workers, pin_memory=True)

    lr = args.blr * args.batch_size * world / 256
    optimizer = torch.optim.AdamW(lrd_groups(vit, lr, args.wd, args.layer_decay), lr=lr, betas=(0.9, 0.999))
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    criterion = SoftTargetCrossEntropy()
    steps_per_epoch = len(train_loader)
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = args.warmup_epochs * steps_per_epoch
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.backbone_frozen = epoch < args.head_only_epochs
        ddp.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            step = epoch * steps_per_epoch + i
            f = cosine_factor(step, warmup_steps, total_steps)
            for g in optimizer.param_groups:
                g["lr"] = g["base_lr"] * f
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(ddp(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(ddp.parameters(), args.clip_grad)
            optimizer.step()
            ema.update(model)
            if rank == 0 and i % 50 == 0:
                print(f"epoch {epoch} [{i}/{steps_per_epoch}] loss {loss.item():.4f} "
                      f"frozen={model.backbone_frozen} {time.time() - t0:.0f}s")

        acc = evaluate(model, val_loader, device)
        ema_acc = evaluate(ema.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} top1 {acc:.2f} ema top1 {ema_acc:.2f}")
            torch.save({"model": vit.state_dict(), "ema": ema.module.vit.state_dict(),
                        "optimizer": optimizer.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
