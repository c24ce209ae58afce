"""Deep ViT (ViT-B/16, 24 blocks) on ImageNet-1k with LayerDrop regularisation.

LayerDrop (Fan et al., 2019): during training each transformer block is skipped
with probability p, which regularises deep models and speeds up training.
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets

from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.models.vision_transformer import VisionTransformer
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV2, NativeScaler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/imagenet")
    p.add_argument("--out", default="/data/runs/vit_b24_layerdrop")
    p.add_argument("--depth", type=int, default=24)
    p.add_argument("--layerdrop", type=float, default=0.2)
    p.add_argument("--batch-size", type=int, default=96)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--warmup-epochs", type=int, default=10)
    p.add_argument("--blr", type=float, default=1e-3, help="lr at global batch 1024")
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--ema-decay", type=float, default=0.9999)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--resume", default="")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class LayerDropViT(VisionTransformer):
    def __init__(self, layerdrop=0.0, **kwargs):
        super().__init__(**kwargs)
        self.layerdrop = layerdrop

    def forward_features(self, x):
        x = self.patch_embed(x)
        x = self._pos_embed(x)
        x = self.norm_pre(x)
        for blk in self.blocks:
            if self.training and torch.rand(()) < self.layerdrop:
                continue
            x = blk(x)
        return self.norm(x)


def build_loaders(args, rank, world):
    train_tf = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                interpolation="bicubic", re_prob=0.25)
    val_tf = create_transform(224, is_training=False, crop_pct=0.9, interpolation="bicubic")
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=128,
                            num_workers=args.workers, pin_memory=True)
    return sampler, train_loader, val_loader


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    hits = torch.zeros(2, device=device, dtype=torch.long)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            pred = model(x).argmax(-1)
        hits[0] += (pred == y).sum()
        hits[1] += y.numel()
    dist.all_reduce(hits)
    return 100.0 * hits[0].item() / hits[1].item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    sampler, train_loader, val_loader = build_loaders(args, rank, world)

    model = LayerDropViT(layerdrop=args.layerdrop, img_size=224, patch_size=16, embed_dim=768,
                         depth=args.depth, num_heads=12, mlp_ratio=4, num_classes=1000,
                         drop_path_rate=0.0, class_token=True, global_pool="token")
    model.to(device)
    ddp_model = DDP(model, device_ids=[local_rank])
    ema = ModelEmaV2(model, decay=args.ema_decay)

    global_batch = args.batch_size * world
    lr = args.blr * global_batch / 1024
    optimizer = create_optimizer_v2(model, opt="adamw", lr=lr, weight_decay=args.wd,
                                    filter_bias_and_bn=True)
    steps_per_epoch = len(train_loader)
    scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs * steps_per_epoch, lr_min=1e-6,
                                  warmup_t=args.warmup_epochs * steps_per_epoch, warmup_lr_init=1e-6,
                                  t_in_epochs=False)
    scaler = NativeScaler()
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    criterion = SoftTargetCrossEntropy()

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        ema.module.load_state_dict(ckpt["ema"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"global batch {global_batch}, lr {lr:.2e}, {steps_per_epoch} steps/epoch")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        t0 = time.time()
        for step, (images, labels) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            images, targets = mixup(images, labels)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(ddp_model(images), targets)
            optimizer.zero_grad(set_to_none=True)
            scaler(loss, optimizer, clip_grad=args.clip_grad, parameters=model.parameters())
            ema.update(model)
            scheduler.step_update(num_updates=epoch * steps_per_epoch + step + 1)
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step}/{steps_per_epoch} loss {loss.item():.4f} "
                      f"lr {optimizer.param_groups[0]['lr']:.2e}")

        acc = evaluate(model, val_loader, device)
        ema_acc = evaluate(ema.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: acc {acc:.2f} ema acc {ema_acc:.2f} ({time.time() - t0:.0f}s)")
            with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "acc": acc, "ema_acc": ema_acc}) + "\n")
            torch.save({"model": model.state_dict(), "ema": ema.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
