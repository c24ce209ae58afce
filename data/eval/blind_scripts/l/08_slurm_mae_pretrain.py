#!/usr/bin/env python
"""MAE pretraining (ViT-B/16 encoder, light decoder) on ImageNet-1k.

Job script (sbatch):
    #SBATCH --nodes=4
    #SBATCH --ntasks-per-node=8
    #SBATCH --gpus-per-node=8
    #SBATCH --cpus-per-task=12
    srun python 08_slurm_mae_pretrain.py --data /lustre/datasets/imagenet --epochs 400
"""
import argparse
import math
import os
import subprocess
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def init_distributed():
    if "SLURM_PROCID" in os.environ:
        rank = int(os.environ["SLURM_PROCID"])
        world_size = int(os.environ["SLURM_NTASKS"])
        if "MASTER_ADDR" not in os.environ:
            host = subprocess.check_output(
                ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]]
            ).decode().split()[0]
            os.environ["MASTER_ADDR"] = host
        os.environ.setdefault("MASTER_PORT", "29512")
    else:
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size,
                            device_id=torch.device("cuda", local_rank))
    return rank, world_size, local_rank


def _stack(dim, depth, heads):
    layer = nn.TransformerEncoderLayer(dim, heads, dim * 4, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
    return nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)


class MAE(nn.Module):
    def __init__(self, img=224, patch=16, dim=768, depth=12, heads=12,
                 dec_dim=512, dec_depth=8, dec_heads=16, mask_ratio=0.75):
        super().__init__()
        self.patch = patch
        self.n = (img // patch) ** 2
        self.mask_ratio = mask_ratio
        self.proj = nn.Conv2d(3, dim, patch, patch)
        self.pos = nn.Parameter(torch.zeros(1, self.n, dim))
        self.enc = _stack(dim, depth, heads)
        self.enc_norm = nn.LayerNorm(dim)
        self.enc_to_dec = nn.Linear(dim, dec_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dec_dim))
        self.dec_pos = nn.Parameter(torch.zeros(1, self.n, dec_dim))
        self.dec = _stack(dec_dim, dec_depth, dec_heads)
        self.dec_norm = nn.LayerNorm(dec_dim)
        self.head = nn.Linear(dec_dim, patch * patch * 3)
        nn.init.normal_(self.pos, std=0.02)
        nn.init.normal_(self.mask_token, std=0.02)
        nn.init.normal_(self.dec_pos, std=0.02)

    def patchify(self, imgs):
        p = self.patch
        B, C, H, W = imgs.shape
        x = imgs.reshape(B, C, H // p, p, W // p, p)
        return x.permute(0, 2, 4, 3, 5, 1).reshape(B, (H // p) * (W // p), p * p * C)

    def forward(self, imgs):
        x = self.proj(imgs).flatten(2).transpose(1, 2) + self.pos
        B, N, D = x.shape
        keep = int(N * (1 - self.mask_ratio))
        noise = torch.rand(B, N, device=x.device)
        ids_shuffle = noise.argsort(1)
        ids_restore = ids_shuffle.argsort(1)
        ids_keep = ids_shuffle[:, :keep]
        x_vis = torch.gather(x, 1, ids_keep[..., None].expand(-1, -1, D))
        h = self.enc_norm(self.enc(x_vis))
        h = self.enc_to_dec(h)
        mask_tok = self.mask_token.expand(B, N - keep, -1)
        h = torch.cat([h, mask_tok], 1)
        h = torch.gather(h, 1, ids_restore[..., None].expand(-1, -1, h.size(-1)))
        h = self.dec_norm(self.dec(h + self.dec_pos))
        pred = self.head(h)
        target = self.patchify(imgs)
        mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
        target = (target - mean) / (var + 1e-6).sqrt()
        mask = torch.ones(B, N, device=x.device)
        mask[:, :keep] = 0
        mask = torch.gather(mask, 1, ids_restore)
        loss = ((pred - target) ** 2).mean(-1)
        return (loss * mask).sum() / mask.sum()


def adjust_lr(optim, epoch_f, args):
    if epoch_f < args.warmup_epochs:
        lr = args.lr * epoch_f / args.warmup_epochs
    else:
        t = (epoch_f - args.warmup_epochs) / (args.epochs - args.warmup_epochs)
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * t))
    for g in optim.param_groups:
        g["lr"] = lr
    return lr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--warmup_epochs", type=int, default=40)
    ap.add_argument("--batch_size", type=int, default=128)
    ap.add_argument("--blr", type=float, default=1.5e-4)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--out", default="/lustre/ckpt/mae_vitb")
    args = ap.parse_args()

    rank, world_size, local_rank = init_distributed()
    device = torch.device("cuda", local_rank)
    args.lr = args.blr * args.batch_size * world_size / 256

    tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.2, 1.0), interpolation=3),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])
    ds = datasets.ImageFolder(os.path.join(args.data, "train"), tf)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                    pin_memory=True, drop_last=True, persistent_workers=True)

    model = MAE().to(device)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)

    start_epoch = 0
    ckpt_path = os.path.join(args.out, "last.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optim.load_state_dict(ck["optim"])
        start_epoch = ck["epoch"] + 1

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world_size}  eff. batch {args.batch_size * world_size}  lr {args.lr:.2e}",
              flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (imgs, _) in enumerate(dl):
            lr = adjust_lr(optim, epoch + it / len(dl), args)
            imgs = imgs.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(imgs)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it}/{len(dl)} loss {loss.item():.4f} lr {lr:.2e}",
                      flush=True)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(),
                        "epoch": epoch}, ckpt_path)
            print(f"epoch {epoch} took {time.time() - t0:.0f}s", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
