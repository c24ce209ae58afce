# MAE pretraining, ViT-L/16 encoder + 8-layer decoder, ImageNet-1k.
# Throughput setup: bf16 autocast, torch.compile, activation checkpointing on encoder blocks,
# fused AdamW, large DDP buckets.
#
#   torchrun --nproc_per_node=8 08_mae_vitl_pretrain.py --data /datasets/imagenet/train --out /shared/mae_vitl
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4.0):
        super().__init__()
        self.heads = heads
        self.n1 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.n2 = nn.LayerNorm(dim, eps=1e-6)
        hid = int(dim * mlp_ratio)
        self.fc1 = nn.Linear(dim, hid)
        self.fc2 = nn.Linear(hid, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(self.n1(x)).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C))
        return x + self.fc2(F.gelu(self.fc1(self.n2(x))))


def sincos_pos_embed(dim, grid):
    y, x = torch.meshgrid(torch.arange(grid, dtype=torch.float32), torch.arange(grid, dtype=torch.float32),
                          indexing="ij")
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float32) / (dim / 4))
    out = [torch.sin(x.flatten()[:, None] * omega), torch.cos(x.flatten()[:, None] * omega),
           torch.sin(y.flatten()[:, None] * omega), torch.cos(y.flatten()[:, None] * omega)]
    return torch.cat(out, dim=1)[None]


class MAE(nn.Module):
    def __init__(self, img=224, patch=16, dim=1024, depth=24, heads=16, dec_dim=512, dec_depth=8,
                 dec_heads=16, mask_ratio=0.75, grad_ckpt=True):
        super().__init__()
        self.patch, self.mask_ratio, self.grad_ckpt = patch, mask_ratio, grad_ckpt
        g = img // patch
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.register_buffer("pos", sincos_pos_embed(dim, g), persistent=False)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.dec_embed = nn.Linear(dim, dec_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dec_dim))
        self.register_buffer("dec_pos", sincos_pos_embed(dec_dim, g), persistent=False)
        self.dec_blocks = nn.ModuleList(Block(dec_dim, dec_heads) for _ in range(dec_depth))
        self.dec_norm = nn.LayerNorm(dec_dim, eps=1e-6)
        self.dec_pred = nn.Linear(dec_dim, patch * patch * 3)
        nn.init.normal_(self.cls, std=0.02)
        nn.init.normal_(self.mask_token, std=0.02)

    def patchify(self, imgs):
        p = self.patch
        B, C, H, W = imgs.shape
        x = imgs.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 3, 5, 1)
        return x.reshape(B, (H // p) * (W // p), p * p * C)

    def forward(self, imgs):
        x = self.patch_embed(imgs).flatten(2).transpose(1, 2) + self.pos
        B, N, D = x.shape
        keep = int(N * (1 - self.mask_ratio))
        noise = torch.rand(B, N, device=x.device)
        ids_shuffle = noise.argsort(dim=1)
        ids_restore = ids_shuffle.argsort(dim=1)
        ids_keep = ids_shuffle[:, :keep]
        x = torch.gather(x, 1, ids_keep.unsqueeze(-1).expand(-1, -1, D))
        mask = torch.ones(B, N, device=x.device)
        mask[:, :keep] = 0
        mask = torch.gather(mask, 1, ids_restore)

        x = torch.cat([self.cls.expand(B, -1, -1), x], dim=1)
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                x = cp.checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        x = self.dec_embed(self.norm(x))

        Dd = x.size(-1)
        mask_tokens = self.mask_token.expand(B, N - keep, -1)
        y = torch.cat([x[:, 1:], mask_tokens], dim=1)
        y = torch.gather(y, 1, ids_restore.unsqueeze(-1).expand(-1, -1, Dd)) + self.dec_pos
        for blk in self.dec_blocks:
            y = blk(y)
        pred = self.dec_pred(self.dec_norm(y))

        target = self.patchify(imgs)
        mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
        target = (target - mean) / (var + 1e-6).sqrt()
        loss = ((pred.float() - target) ** 2).mean(-1)
        return (loss * mask).sum() / mask.sum()


def adjust_lr(opt, step, total, warmup, peak, min_lr=0.0):
    if step < warmup:
        lr = peak * step / warmup
    else:
        lr = min_lr + (peak - min_lr) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
    for g in opt.param_groups:
        g["lr"] = lr
    return lr


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=800)
    p.add_argument("--warmup-epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--blr", type=float, default=1.5e-4)
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--no-grad-ckpt", action="store_true")
    p.add_argument("--resume", default="")
    args = p.parse_args()

    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.benchmark = True

    tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.2, 1.0), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])
    ds = datasets.ImageFolder(args.data, transform=tf)
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)

    model = MAE(grad_ckpt=not args.no_grad_ckpt).to(dev)
    eff_bs = args.batch_size * world
    lr = args.blr * eff_bs / 256
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1 or n in ("cls", "mask_token")]
    decay = [p for p in decay if all(p is not q for q in no_decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), fused=True)

    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start_epoch = ck["epoch"] + 1

    ddp = DDP(model, device_ids=[local_rank], bucket_cap_mb=128, gradient_as_bucket_view=True)
    step_fn = torch.compile(ddp)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"eff batch {eff_bs}, lr {lr:.2e}, {len(loader)} it/epoch", flush=True)

    total = args.epochs * len(loader)
    warm = args.warmup_epochs * len(loader)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        loss_sum = torch.zeros((), device=dev)
        for i, (imgs, _) in enumerate(loader):
            step = epoch * len(loader) + i
            cur_lr = adjust_lr(opt, step, total, warm, lr)
            imgs = imgs.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = step_fn(imgs)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
            if (i + 1) % 100 == 0:
                ev1.record()
                ev1.synchronize()
                sec = ev0.elapsed_time(ev1) / 1000
                dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} it {i + 1}/{len(loader)} loss {loss_sum.item() / 100:.4f} "
                          f"lr {cur_lr:.2e} {100 * eff_bs / sec:.0f} img/s", flush=True)
                loss_sum.zero_()
                ev0.record()

        if rank == 0 and (epoch % 20 == 0 or epoch + 1 == args.epochs):
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "args": vars(args)},
                       os.path.join(args.out, f"checkpoint-{epoch}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
