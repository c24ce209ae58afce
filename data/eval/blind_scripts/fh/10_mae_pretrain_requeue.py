#!/usr/bin/env python
"""Masked autoencoder (MAE ViT-L/16) pretraining on histopathology tiles.

Runs as a chain of requeued 24h jobs:

    #SBATCH --job-name=mae-l16
    #SBATCH --nodes=8 --ntasks-per-node=4 --gpus-per-node=4 --cpus-per-task=16
    #SBATCH --time=1-00:00:00
    #SBATCH --signal=USR1@600
    #SBATCH --requeue

    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_PORT=$(expr 10000 + $(echo -n $SLURM_JOBID | tail -c 4))
    srun python mae_pretrain.py --data /lustre/pathology/tiles_train.txt \
        --output_dir /lustre/pathology/mae_l16

The epoch loop polls for the preemption signal; when it arrives the run
writes a checkpoint and asks Slurm to requeue it.
"""
import argparse
import math
import os
import signal
import subprocess
import time

import torch
import torch.distributed as dist
from PIL import Image
from timm.models.vision_transformer import Block, PatchEmbed
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision import transforms

GOT_SIGNAL = False


def sigusr1_handler(signum, frame):
    global GOT_SIGNAL
    GOT_SIGNAL = True


class TileList(Dataset):
    def __init__(self, list_file, transform):
        with open(list_file) as f:
            self.paths = [l.strip() for l in f if l.strip()]
        self.transform = transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.transform(Image.open(self.paths[i]).convert("RGB"))


class MAE(nn.Module):
    def __init__(self, img=224, patch=16, dim=1024, depth=24, heads=16,
                 dec_dim=512, dec_depth=8, dec_heads=16, mask_ratio=0.75):
        super().__init__()
        self.patch = patch
        self.mask_ratio = mask_ratio
        self.embed = PatchEmbed(img, patch, 3, dim)
        n = self.embed.num_patches
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.zeros(1, n + 1, dim))
        self.blocks = nn.ModuleList([Block(dim, heads, 4.0, qkv_bias=True) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.dec_embed = nn.Linear(dim, dec_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dec_dim))
        self.dec_pos = nn.Parameter(torch.zeros(1, n + 1, dec_dim))
        self.dec_blocks = nn.ModuleList([Block(dec_dim, dec_heads, 4.0, qkv_bias=True)
                                         for _ in range(dec_depth)])
        self.dec_norm = nn.LayerNorm(dec_dim)
        self.pred = nn.Linear(dec_dim, patch * patch * 3)
        for p in (self.cls, self.pos, self.mask_token, self.dec_pos):
            nn.init.trunc_normal_(p, std=0.02)

    def patchify(self, imgs):
        p = self.patch
        b, c, h, w = imgs.shape
        x = imgs.reshape(b, c, h // p, p, w // p, p)
        return torch.einsum("nchpwq->nhwpqc", x).reshape(b, (h // p) * (w // p), p * p * c)

    def forward(self, imgs):
        x = self.embed(imgs) + self.pos[:, 1:]
        b, n, d = x.shape
        keep = int(n * (1 - self.mask_ratio))
        noise = torch.rand(b, n, device=x.device)
        ids_shuffle = noise.argsort(1)
        ids_restore = ids_shuffle.argsort(1)
        x = torch.gather(x, 1, ids_shuffle[:, :keep, None].expand(-1, -1, d))
        mask = torch.ones(b, n, device=x.device)
        mask[:, :keep] = 0
        mask = torch.gather(mask, 1, ids_restore)

        x = torch.cat([(self.cls + self.pos[:, :1]).expand(b, -1, -1), x], 1)
        for blk in self.blocks:
            x = blk(x)
        x = self.dec_embed(self.norm(x))
        tokens = torch.cat([x[:, 1:], self.mask_token.expand(b, n - keep, -1)], 1)
        tokens = torch.gather(tokens, 1, ids_restore[:, :, None].expand(-1, -1, x.shape[2]))
        x = torch.cat([x[:, :1], tokens], 1) + self.dec_pos
        for blk in self.dec_blocks:
            x = blk(x)
        pred = self.pred(self.dec_norm(x))[:, 1:]

        target = self.patchify(imgs)
        mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
        target = (target - mean) / (var + 1e-6).sqrt()
        loss = ((pred - target) ** 2).mean(-1)
        return (loss * mask).sum() / mask.sum()


def save_checkpoint(path, model, optimizer, scaler, epoch, it):
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(), "epoch": epoch, "iter": it}, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--epochs", type=int, default=800)
    ap.add_argument("--warmup_epochs", type=int, default=40)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--blr", type=float, default=1.5e-4)
    args = ap.parse_args()

    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    gpu = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method="env://", world_size=world, rank=rank)
    signal.signal(signal.SIGUSR1, sigusr1_handler)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    tf = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.2, 1.0)),
                             transforms.RandomHorizontalFlip(), transforms.RandomVerticalFlip(),
                             transforms.ToTensor(),
                             transforms.Normalize([0.70, 0.55, 0.70], [0.17, 0.20, 0.15])])
    ds = TileList(args.data, tf)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        num_workers=int(os.environ["SLURM_CPUS_PER_TASK"]), pin_memory=True)

    model = DistributedDataParallel(MAE().cuda(), device_ids=[gpu])
    lr = args.blr * args.batch_size * world / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.05)
    scaler = torch.cuda.amp.GradScaler()
    iters = len(loader)

    ckpt = os.path.join(args.output_dir, "checkpoint-last.pth")
    start_epoch, start_it = 0, 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, map_location="cpu")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        start_epoch, start_it = state["epoch"], state["iter"]

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, imgs in enumerate(loader):
            if epoch == start_epoch and it < start_it:
                continue
            e = epoch + it / iters
            cur_lr = lr * e / args.warmup_epochs if e < args.warmup_epochs else \
                lr * 0.5 * (1 + math.cos(math.pi * (e - args.warmup_epochs) /
                                         (args.epochs - args.warmup_epochs)))
            for g in optimizer.param_groups:
                g["lr"] = cur_lr
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(imgs.cuda(non_blocking=True))
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

            if it % 20 == 0:
                flag = torch.tensor([int(GOT_SIGNAL)], device="cuda")
                dist.all_reduce(flag)
                if flag.item() > 0:
                    save_checkpoint(ckpt, model, optimizer, scaler, epoch, it + 1)
                    dist.barrier()
                    if rank == 0:
                        subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]])
                    dist.destroy_process_group()
                    return
                if rank == 0:
                    print(f"ep {epoch} it {it}/{iters} loss {loss.item():.4f} lr {cur_lr:.2e} "
                          f"{(time.time() - t0) / (it + 1):.2f}s/it", flush=True)

        if rank == 0:
            save_checkpoint(ckpt, model, optimizer, scaler, epoch + 1, 0)
            if (epoch + 1) % 50 == 0:
                torch.save(model.module.state_dict(),
                           os.path.join(args.output_dir, f"mae_ep{epoch + 1}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
