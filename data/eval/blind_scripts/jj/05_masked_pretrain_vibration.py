"""Self-supervised masked-patch pretraining (PatchTST-style) on bearing vibration
sensors, with resumable checkpoints (jobs are preempted every 4 h on our cluster).

torchrun --standalone --nproc_per_node=8 05_masked_pretrain_vibration.py \
    --data /lustre/vib/windows --save-dir /lustre/vib/ckpt/pretrain_v3 --resume auto
"""
import argparse
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def build_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="folder of per-sensor .npy traces")
    p.add_argument("--save-dir", required=True)
    p.add_argument("--resume", default="", help="path, or 'auto' for latest in save-dir")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--patch", type=int, default=32)
    p.add_argument("--mask-ratio", type=float, default=0.4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--bs", type=int, default=96)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--base-lr", type=float, default=1.5e-4)
    p.add_argument("--save-every", type=int, default=1)
    p.add_argument("--workers", type=int, default=8)
    return p


class TraceWindows(Dataset):
    """Memory-mapped per-sensor traces; per-sensor mean/std are stored next to each file."""

    def __init__(self, folder, ctx, hop):
        self.files = sorted(glob.glob(os.path.join(folder, "*.npy")))
        self.ctx = ctx
        self.traces = [np.load(f, mmap_mode="r") for f in self.files]
        self.stats = [np.load(f.replace(".npy", ".stats.npy")) for f in self.files]
        self.index = [(k, s) for k, t in enumerate(self.traces)
                      for s in range(0, len(t) - ctx + 1, hop)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        k, s = self.index[i]
        mean, std = self.stats[k]
        w = (np.asarray(self.traces[k][s:s + self.ctx], dtype=np.float32) - mean) / std
        return torch.from_numpy(w)


class MaskedPatchModel(nn.Module):
    def __init__(self, ctx, patch, width, depth, heads):
        super().__init__()
        self.patch = patch
        self.n = ctx // patch
        self.embed = nn.Linear(patch, width)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, width))
        self.pos = nn.Parameter(torch.randn(1, self.n, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, 0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.norm = nn.LayerNorm(width)
        self.recon = nn.Linear(width, patch)

    def forward(self, x, mask_ratio):
        B = x.shape[0]
        patches = x.view(B, self.n, self.patch)
        tok = self.embed(patches)
        mask = torch.rand(B, self.n, device=x.device) < mask_ratio
        tok = torch.where(mask.unsqueeze(-1), self.mask_token.expand(B, self.n, -1), tok)
        h = self.norm(self.encoder(tok + self.pos))
        rec = self.recon(h)
        loss = ((rec - patches) ** 2).mean(-1)
        return (loss * mask).sum() / mask.sum().clamp_min(1)


def cosine_lr(step, total, warmup, peak):
    if step < warmup:
        return peak * step / warmup
    return 0.5 * peak * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def latest_checkpoint(save_dir):
    ckpts = sorted(glob.glob(os.path.join(save_dir, "ep*.pt")))
    return ckpts[-1] if ckpts else ""


def main():
    args = build_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    ds = TraceWindows(args.data, args.ctx, hop=args.ctx // 2)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = MaskedPatchModel(args.ctx, args.patch, args.width, args.depth, args.heads).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    peak_lr = args.base_lr * args.bs * world / 256
    opt = torch.optim.AdamW(ddp.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.05)
    scaler = GradScaler()
    total_steps = args.epochs * len(loader)
    warmup = 5 * len(loader)

    start_epoch, step = 0, 0
    resume = latest_checkpoint(args.save_dir) if args.resume == "auto" else args.resume
    ckpt = None
    if resume:
        ckpt = torch.load(resume)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, step = ckpt["epoch"] + 1, ckpt["step"]
        if rank == 0:
            print(f"resumed {resume} at epoch {start_epoch}", flush=True)
    best_loss = ckpt["best_loss"] if ckpt is not None else float("inf")

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"{len(ds)} windows, {len(loader)} steps/epoch/rank, peak lr {peak_lr:.2e}")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        tic = time.time()
        meter = torch.zeros(2, device=device)
        for x in loader:
            x = x.to(device, non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = cosine_lr(step, total_steps, warmup, peak_lr)
            with autocast(dtype=torch.float16):
                loss = ddp(x, args.mask_ratio)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            meter[0] += loss.detach().float()
            meter[1] += 1
            step += 1

        dist.all_reduce(meter)
        epoch_loss = (meter[0] / meter[1]).item()
        if rank == 0:
            print(f"epoch {epoch:03d} masked-mse {epoch_loss:.5f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"{time.time() - tic:.0f}s", flush=True)
            best_loss = min(best_loss, epoch_loss)
            if (epoch + 1) % args.save_every == 0 or epoch == args.epochs - 1:
                state = {"model": model.state_dict(), "opt": opt.state_dict(),
                         "scaler": scaler.state_dict(), "epoch": epoch, "step": step,
                         "best_loss": best_loss, "args": vars(args)}
                path = os.path.join(args.save_dir, f"ep{epoch:04d}.pt")
                torch.save(state, path + ".part")
                os.replace(path + ".part", path)
        dist.barrier()

    if rank == 0:
        torch.save(model.state_dict(), os.path.join(args.save_dir, "encoder_final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
