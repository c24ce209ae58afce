"""Semantic-token LM for music (MusicLM "semantic stage"): k-means units of MERT-v1-330M
layer-12 features (1024 clusters, 75 Hz), deduplicated, pre-extracted per track.

units/<split>/<track>.npy  (int16, variable length)

    torchrun --nproc_per_node=8 16_semantic_token_lm.py --units /data/units_mert_l12_k1024 --save_dir runs/semantic_lm
"""
import argparse
import glob
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

K = 1024
BOS, PAD = K, K + 1
VOCAB = K + 2

logger = logging.getLogger(__name__)


class UnitClips(Dataset):
    def __init__(self, files, max_len, random_crop=True):
        self.files, self.max_len, self.random_crop = files, max_len, random_crop

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        u = np.load(self.files[i]).astype(np.int64)
        if len(u) > self.max_len:
            s = np.random.randint(0, len(u) - self.max_len + 1) if self.random_crop else 0
            u = u[s:s + self.max_len]
        return torch.from_numpy(u)


class Collate:
    """Pads to the longest clip in the batch; clips shorter than min_len (mostly silence
    or intros that dedup to a handful of units) are dropped."""

    def __init__(self, min_len):
        self.min_len = min_len

    def __call__(self, clips):
        clips = [c for c in clips if len(c) >= self.min_len]
        if not clips:
            return None
        T = max(len(c) for c in clips) + 1
        x = torch.full((len(clips), T), PAD, dtype=torch.long)
        for i, c in enumerate(clips):
            x[i, 0] = BOS
            x[i, 1:len(c) + 1] = c
        return x


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.w1 = nn.Linear(d, 4 * d, bias=False)
        self.w2 = nn.Linear(4 * d, d, bias=False)

    def forward(self, x, rope):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.h, C // self.h).unbind(2)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.w2(F.gelu(self.w1(self.norm2(x))))


def rope_cache(T, dh, device, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, dh, 2, device=device).float() / dh)
    f = torch.outer(torch.arange(T, device=device).float(), inv)
    return torch.cos(f), torch.sin(f)


def apply_rope(x, rope):  # x [B, T, H, Dh]
    cos, sin = rope
    x1, x2 = x[..., ::2], x[..., 1::2]
    cos, sin = cos[None, :, None], sin[None, :, None]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


class SemanticLM(nn.Module):
    def __init__(self, d=1024, layers=24, heads=16):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.out = nn.Linear(d, VOCAB, bias=False)
        self.dh = d // heads

    def forward(self, x):
        rope = rope_cache(x.size(1), self.dh, x.device)
        h = self.emb(x)
        for b in self.blocks:
            h = b(h, rope)
        return self.out(self.norm(h))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    tot = torch.zeros(3, device=device, dtype=torch.float64)
    for x in loader:
        if x is None:
            continue
        x = x.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x[:, :-1]).float()
        y = x[:, 1:]
        tot[0] += F.cross_entropy(logits.transpose(1, 2), y, ignore_index=PAD, reduction="sum")
        tot[1] += ((logits.argmax(-1) == y) & (y != PAD)).sum()
        tot[2] += (y != PAD).sum()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--units", required=True)
    p.add_argument("--save_dir", required=True)
    p.add_argument("--max_len", type=int, default=1500, help="units per clip (~30 s before dedup)")
    p.add_argument("--min_len", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--num_workers", type=int, default=8)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s %(message)s")
    torch.manual_seed(1234)

    train_files = sorted(glob.glob(os.path.join(args.units, "train", "*.npy")))
    valid_files = sorted(glob.glob(os.path.join(args.units, "valid", "*.npy")))
    collate = Collate(args.min_len)
    train_ds = UnitClips(train_files, args.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=args.num_workers, pin_memory=True, drop_last=True)
    valid_dl = DataLoader(UnitClips(valid_files[rank::world], args.max_len, random_crop=False),
                          args.batch_size, collate_fn=collate, num_workers=4)
    logger.info("train clips %d, valid clips %d, world %d", len(train_ds), len(valid_files), world)

    model = SemanticLM().to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))

    os.makedirs(args.save_dir, exist_ok=True)
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for x in train_dl:
            if x is None:
                continue
            x = x.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = ddp(x[:, :-1])
            loss = F.cross_entropy(logits.float().transpose(1, 2), x[:, 1:], ignore_index=PAD)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f lr %.2e %.2fs/100", epoch, step, loss.item(),
                            sched.get_last_lr()[0], time.time() - t0)
                t0 = time.time()

        vloss, vacc = evaluate(model, valid_dl, device)
        logger.info("epoch %d valid loss %.4f acc %.4f", epoch, vloss, vacc)
        if rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "step": step}, os.path.join(args.save_dir, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
