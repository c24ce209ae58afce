"""ViT-B/16 ImageNet training at a global batch of 4096 with LayerDrop and activation checkpointing.

LayerDrop (Fan et al. 2019) skips whole transformer blocks at random during
training; activation checkpointing lets 128 images of ViT-B fit per 40GB GPU.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        20_vit_layerdrop_ckpt.py --data /shared/imagenet --batch-size 128
"""
import argparse
import math
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
import wandb


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(),
                                 nn.Linear(int(dim * mlp_ratio), dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, img=224, patch=16, dim=768, depth=12, heads=12, num_classes=1000,
                 layer_drop=0.0, grad_ckpt=False):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        n = (img // patch) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        self.layer_drop = layer_drop
        self.grad_ckpt = grad_ckpt
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.size(0), -1, -1), x], dim=1) + self.pos_embed
        for blk in self.blocks:
            if self.training and self.layer_drop > 0 and random.random() < self.layer_drop:
                continue
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x, use_reentrant=True)
            else:
                x = blk(x)
        return self.head(self.norm(x)[:, 0])


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--warmup-epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--blr", type=float, default=1e-3, help="lr per 1024 images")
    p.add_argument("--wd", type=float, default=0.3)
    p.add_argument("--layer-drop", type=float, default=0.1)
    p.add_argument("--no-grad-ckpt", action="store_true")
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--out", default="/shared/exp/vitb_layerdrop")
    return p.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1234 + rank)
    torch.manual_seed(1234)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.RandomHorizontalFlip(), transforms.RandAugment(2, 9), transforms.ToTensor(), norm]))
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize(256, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(224), transforms.ToTensor(), norm]))
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=256,
                            num_workers=args.workers, pin_memory=True)

    net = ViT(layer_drop=args.layer_drop, grad_ckpt=not args.no_grad_ckpt).to(device)
    # blocks skipped by LayerDrop get no gradient in that step
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)

    lr = args.blr * args.batch_size * world / 1024
    decay = [p for n, p in net.named_parameters() if p.ndim > 1 and "pos_embed" not in n and "cls_token" not in n]
    no_decay = [p for n, p in net.named_parameters() if not (p.ndim > 1 and "pos_embed" not in n and "cls_token" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    steps_per_epoch = len(train_loader)
    total, warmup = args.epochs * steps_per_epoch, args.warmup_epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: s / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup))))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="vit-large-batch", config=vars(args), dir=args.out)
        print(f"global batch {args.batch_size * world}, lr {lr:.2e}")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y, label_smoothing=args.smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 100 == 0:
                wandb.log({"train/loss": loss.item(), "lr": scheduler.get_last_lr()[0],
                           "step": epoch * steps_per_epoch + it})

        net.eval()
        stats = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for x, y in val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                stats[0] += (net(x).argmax(1) == y).sum()
                stats[1] += y.numel()
        dist.all_reduce(stats)
        top1 = (100 * stats[0] / stats[1]).item()
        if rank == 0:
            wandb.log({"val/top1": top1, "epoch": epoch})
            print(f"epoch {epoch}: top1 {top1:.2f}")
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "checkpoint.pth"))

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
