# MAE ViT-L/16 pre-training with gradient accumulation (4096 global batch on 2 nodes x 8 GPUs).
import argparse
import contextlib
import json
import math
import os
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.transforms as transforms
from timm.models.vision_transformer import Block, PatchEmbed
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.datasets import ImageFolder


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_path", default="/shared/datasets/imagenet/train")
    parser.add_argument("--output_dir", default="/shared/experiments/mae_vitl")
    parser.add_argument("--batch_size", default=64, type=int, help="per-GPU micro batch")
    parser.add_argument("--accum_iter", default=4, type=int)
    parser.add_argument("--epochs", default=1600, type=int)
    parser.add_argument("--warmup_epochs", default=40, type=int)
    parser.add_argument("--blr", default=1.5e-4, type=float)
    parser.add_argument("--min_lr", default=0.0, type=float)
    parser.add_argument("--weight_decay", default=0.05, type=float)
    parser.add_argument("--mask_ratio", default=0.75, type=float)
    parser.add_argument("--num_workers", default=12, type=int)
    parser.add_argument("--ckpt_every", default=20, type=int)
    parser.add_argument("--seed", default=0, type=int)
    return parser.parse_args()


class MAE(nn.Module):
    def __init__(self, img_size=224, patch=16, dim=1024, depth=24, heads=16, dec_dim=512, dec_depth=8, dec_heads=16):
        super().__init__()
        norm = partial(nn.LayerNorm, eps=1e-6)
        self.patch_embed = PatchEmbed(img_size, patch, 3, dim)
        n = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        # learnable but tiny-lr positional embeddings would also work; fixed ones are simpler
        self.register_buffer("pos_embed", self._sincos(n, dim), persistent=False)
        self.blocks = nn.ModuleList([Block(dim, heads, 4.0, qkv_bias=True, norm_layer=norm) for _ in range(depth)])
        self.norm = norm(dim)
        self.decoder_embed = nn.Linear(dim, dec_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dec_dim))
        self.register_buffer("decoder_pos_embed", self._sincos(n, dec_dim), persistent=False)
        self.decoder_blocks = nn.ModuleList([Block(dec_dim, dec_heads, 4.0, qkv_bias=True, norm_layer=norm)
                                             for _ in range(dec_depth)])
        self.decoder_norm = norm(dec_dim)
        self.decoder_pred = nn.Linear(dec_dim, patch * patch * 3)
        self.patch = patch
        nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.mask_token, std=0.02)

    @staticmethod
    def _sincos(n, dim):
        g = int(n ** 0.5)
        y, x = torch.meshgrid(torch.arange(g, dtype=torch.float32), torch.arange(g, dtype=torch.float32),
                              indexing="ij")
        omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float32) / (dim / 4))
        out_x = x.flatten()[:, None] * omega[None]
        out_y = y.flatten()[:, None] * omega[None]
        pe = torch.cat([out_x.sin(), out_x.cos(), out_y.sin(), out_y.cos()], dim=1)
        return torch.cat([torch.zeros(1, dim), pe], dim=0).unsqueeze(0)

    def forward(self, imgs, mask_ratio):
        x = self.patch_embed(imgs) + self.pos_embed[:, 1:]
        B, L, D = x.shape
        keep = int(L * (1 - mask_ratio))
        # independent random mask for every sample (and every rank)
        ids_shuffle = torch.argsort(torch.rand(B, L, device=x.device), dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        x = torch.gather(x, 1, ids_shuffle[:, :keep, None].expand(-1, -1, D))
        mask = torch.ones(B, L, device=x.device)
        mask[:, :keep] = 0
        mask = torch.gather(mask, 1, ids_restore)

        cls = (self.cls_token + self.pos_embed[:, :1]).expand(B, -1, -1)
        x = torch.cat([cls, x], dim=1)
        for blk in self.blocks:
            x = blk(x)
        x = self.decoder_embed(self.norm(x))

        mask_tokens = self.mask_token.expand(B, L - keep, -1)
        x_ = torch.cat([x[:, 1:], mask_tokens], dim=1)
        x_ = torch.gather(x_, 1, ids_restore[:, :, None].expand(-1, -1, x.shape[-1]))
        x = torch.cat([x[:, :1], x_], dim=1) + self.decoder_pos_embed
        for blk in self.decoder_blocks:
            x = blk(x)
        pred = self.decoder_pred(self.decoder_norm(x))[:, 1:]

        p = self.patch
        h = imgs.shape[2] // p
        target = imgs.reshape(B, 3, h, p, h, p).permute(0, 2, 4, 3, 5, 1).reshape(B, h * h, p * p * 3)
        mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
        target = (target - mean) / (var + 1e-6) ** 0.5
        loss = ((pred - target) ** 2).mean(-1)
        return (loss * mask).sum() / mask.sum()


def lr_for(epoch_float, args):
    if epoch_float < args.warmup_epochs:
        return args.lr * epoch_float / args.warmup_epochs
    t = (epoch_float - args.warmup_epochs) / (args.epochs - args.warmup_epochs)
    return args.min_lr + (args.lr - args.min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different seed per rank: the augmentation and the masks must not repeat across GPUs;
    # DDP broadcasts rank 0's initial weights, so the model still starts identical everywhere
    torch.manual_seed(args.seed + rank)

    eff_batch = args.batch_size * args.accum_iter * world_size
    args.lr = args.blr * eff_batch / 256

    tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.2, 1.0), interpolation=3),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    dataset = ImageFolder(args.data_path, transform=tf)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = DDP(MAE().to(device), device_ids=[local_rank], output_device=local_rank)
    raw_model = model.module
    decay = [p for n, p in raw_model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in raw_model.named_parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    scaler = torch.cuda.amp.GradScaler()

    writer = None
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.output_dir, "tb"))
        print(f"world {world_size}, eff. batch {eff_batch}, lr {args.lr:.3e}")

    start_epoch = 0
    last = os.path.join(args.output_dir, "last.pth")
    if os.path.exists(last):
        state = torch.load(last, map_location="cpu")
        raw_model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        start_epoch = state["epoch"] + 1

    steps = len(loader)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        optimizer.zero_grad(set_to_none=True)
        for i, (imgs, _) in enumerate(loader):
            boundary = (i + 1) % args.accum_iter == 0
            if i % args.accum_iter == 0:
                lr = lr_for(epoch + i / steps, args)
                for g in optimizer.param_groups:
                    g["lr"] = lr
            imgs = imgs.to(device, non_blocking=True)
            # skip the gradient all-reduce on the micro-steps in between
            ctx = contextlib.nullcontext() if boundary else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(imgs, args.mask_ratio)
                scaler.scale(loss / args.accum_iter).backward()
            if boundary:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
            tot += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if writer is not None and boundary and (i // args.accum_iter) % 25 == 0:
                step = epoch * (steps // args.accum_iter) + i // args.accum_iter
                writer.add_scalar("loss/rank0", loss.item(), step)
                writer.add_scalar("lr", lr, step)

        dist.all_reduce(tot)
        mean_loss = (tot[0] / tot[1]).item()
        if rank == 0:
            print(json.dumps({"epoch": epoch, "loss": mean_loss, "sec": round(time.time() - t0)}), flush=True)
            writer.add_scalar("loss/epoch", mean_loss, epoch)
            state = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scaler": scaler.state_dict(), "epoch": epoch}
            torch.save(state, last + ".tmp")
            os.replace(last + ".tmp", last)
            if (epoch + 1) % args.ckpt_every == 0:
                torch.save({"model": raw_model.state_dict(), "epoch": epoch},
                           os.path.join(args.output_dir, f"mae_vitl_ep{epoch + 1}.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
