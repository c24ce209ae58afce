"""Masked EEG modelling on the TUH EEG corpus (LaBraM-style channel-patch tokens).

Recordings were resampled to 200 Hz, average-referenced, filtered 0.1-75 Hz
with a 60 Hz notch, and written as shards of fixed 8-s crops over the common
19 channels of the 10-20 system:  shards/tuh_{k:05d}.npy  ->  (N, 19, 1600) fp16,
with shards/sizes.json listing the number of crops per shard.
Each channel's 8-s crop is cut into 1-s patches (200 samples); 50 % of the
patch tokens are masked and their amplitude / phase spectra are predicted.

Long job on a shared cluster with preemption, so it resumes from --resume.

    torchrun --nproc_per_node=8 15_eeg_foundation_pretrain_resume.py \
        --shards /scratch/tuh/shards --resume /scratch/ckpt/eegfm/last.pt
"""
import argparse
import glob
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

N_CH, PATCH, N_PATCH = 19, 200, 8


class ShardDataset(Dataset):
    """Index over all crops of all shards; shards are memory-mapped lazily, one at a time per worker."""

    def __init__(self, shard_dir):
        self.files = sorted(glob.glob(os.path.join(shard_dir, "tuh_*.npy")))
        with open(os.path.join(shard_dir, "sizes.json")) as fh:
            sizes = json.load(fh)  # list[int], one per shard
        self.index = [(f, i) for f, n in zip(range(len(self.files)), sizes) for i in range(n)]
        self._cache_key, self._cache = None, None

    def __len__(self):
        return len(self.index)

    def __getitem__(self, j):
        f, i = self.index[j]
        if f != self._cache_key:
            self._cache = np.load(self.files[f], mmap_mode="r")
            self._cache_key = f
        x = torch.from_numpy(np.asarray(self._cache[i], dtype=np.float32))
        x = x / 100.0  # uV -> 0.1 mV units, as in LaBraM
        return x


class EEGFoundation(nn.Module):
    def __init__(self, dim=512, depth=12, heads=8):
        super().__init__()
        self.patch_embed = nn.Sequential(
            nn.Conv1d(1, 8, 15, 8, 7), nn.GroupNorm(4, 8), nn.GELU(),
            nn.Conv1d(8, 8, 3, 1, 1), nn.GroupNorm(4, 8), nn.GELU(),
            nn.Flatten(), nn.LazyLinear(dim),
        )
        self.ch_emb = nn.Embedding(N_CH, dim)
        self.time_emb = nn.Embedding(N_PATCH, dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, 0.1, activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.norm = nn.LayerNorm(dim)
        n_freq = PATCH // 2 + 1
        self.amp_head = nn.Linear(dim, n_freq)
        self.phase_head = nn.Linear(dim, n_freq)
        self.register_buffer("ch_ids", torch.arange(N_CH).repeat_interleave(N_PATCH))
        self.register_buffer("t_ids", torch.arange(N_PATCH).repeat(N_CH))

    def forward(self, x, mask):
        # x: (B, C, T) -> tokens (B, C*P, PATCH)
        B = x.size(0)
        patches = x.view(B, N_CH * N_PATCH, PATCH)
        tok = self.patch_embed(patches.reshape(-1, 1, PATCH)).view(B, N_CH * N_PATCH, -1)
        tok = torch.where(mask[..., None], self.mask_token.expand_as(tok), tok)
        tok = tok + self.ch_emb(self.ch_ids) + self.time_emb(self.t_ids)
        h = self.norm(self.encoder(tok))
        spec = torch.fft.rfft(patches, dim=-1)
        amp_t = torch.log1p(spec.abs())
        phase_t = torch.angle(spec)
        loss_amp = F.mse_loss(self.amp_head(h)[mask], amp_t[mask])
        loss_phase = F.mse_loss(self.phase_head(h)[mask], phase_t[mask])
        return loss_amp + loss_phase


def cosine_lr(step, base, warmup, total, min_lr=1e-6):
    if step < warmup:
        return base * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (base - min_lr) * (1 + math.cos(math.pi * p))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", required=True)
    ap.add_argument("--ckpt_dir", default="/scratch/ckpt/eegfm")
    ap.add_argument("--resume", default="")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup_epochs", type=int, default=5)
    ap.add_argument("--mask_ratio", type=float, default=0.5)
    ap.add_argument("--save_every_steps", type=int, default=2000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    ds = ShardDataset(args.shards)
    # shuffle=False keeps every worker on one shard at a time; crops are already shuffled on disk
    sampler = DistributedSampler(ds, shuffle=False, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True,
                    drop_last=True, persistent_workers=True, prefetch_factor=4)

    model = EEGFoundation().to(device)
    with torch.no_grad():  # materialise the LazyLinear before DDP
        model(torch.zeros(2, N_CH, N_PATCH * PATCH, device=device),
              torch.zeros(2, N_CH * N_PATCH, dtype=torch.bool, device=device).index_fill_(1, torch.tensor([0], device=device), True))
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "emb" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "emb" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98))
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, global_step = 0, 0
    if args.resume and os.path.isfile(args.resume):
        checkpoint = torch.load(args.resume)
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])
        start_epoch, global_step = checkpoint["epoch"], checkpoint["global_step"]
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}, step {global_step}")

    model = DDP(model, device_ids=[local_rank])
    torch.manual_seed(1 + rank)  # different token masks on every rank
    steps_per_epoch = len(dl)
    total_steps = args.epochs * steps_per_epoch
    skip = global_step - start_epoch * steps_per_epoch  # batches already done in the interrupted epoch

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    def save(epoch):
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch, "global_step": global_step},
                       os.path.join(args.ckpt_dir, "last.pt.tmp"))
            os.replace(os.path.join(args.ckpt_dir, "last.pt.tmp"), os.path.join(args.ckpt_dir, "last.pt"))

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, x in enumerate(dl):
            if epoch == start_epoch and i < skip:
                continue
            lr = cosine_lr(global_step, args.lr, args.warmup_epochs * steps_per_epoch, total_steps)
            for g in opt.param_groups:
                g["lr"] = lr
            x = x.to(device, non_blocking=True)
            mask = torch.rand(x.size(0), N_CH * N_PATCH, device=device) < args.mask_ratio
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x, mask)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), 3.0)
            scaler.step(opt)
            scaler.update()
            global_step += 1
            if global_step % 100 == 0 and rank == 0:
                print(f"ep {epoch} step {global_step} loss {loss.item():.4f} gnorm {gnorm:.2f} lr {lr:.2e} "
                      f"{(time.time() - t0) / (i + 1 - (skip if epoch == start_epoch else 0)):.3f}s/it", flush=True)
            if global_step % args.save_every_steps == 0:
                save(epoch)
        save(epoch + 1)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
