"""Genre-conditioned music LM over pre-extracted EnCodec tokens.

Each track was tokenised offline into `<track_id>.npy` of shape [K, T] (int16, 50 Hz).
We train on random 30 s windows; a held-out set of tracks gives the validation loss.

Usage:
    torchrun --nproc_per_node=8 04_music_token_lm_precomputed.py \
        --codes-dir /mnt/fsx/codes/encodec32k --meta /mnt/fsx/codes/meta.json
"""
import argparse
import json
import math
import os
import random
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class Cfg:
    n_q: int = 4
    card: int = 2048
    dim: int = 1024
    n_layers: int = 24
    n_heads: int = 16
    window: int = 1500  # 30 s @ 50 Hz
    n_genres: int = 64
    cond_dropout: float = 0.1


class TrackWindows(Dataset):
    def __init__(self, codes_dir, track_ids, genres, window, train=True):
        self.codes_dir, self.ids, self.genres = codes_dir, track_ids, genres
        self.window, self.train = window, train

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        tid = self.ids[i]
        codes = np.load(os.path.join(self.codes_dir, f"{tid}.npy"), mmap_mode="r")
        T = codes.shape[1]
        if T > self.window:
            start = random.randint(0, T - self.window) if self.train else (T - self.window) // 2
            codes = codes[:, start : start + self.window]
        codes = torch.from_numpy(np.asarray(codes, dtype=np.int64))
        length = codes.shape[1]
        if length < self.window:
            codes = F.pad(codes, (0, self.window - length), value=-1)
        return codes, self.genres[tid], length


def split_tracks(track_ids, valid_frac):
    track_ids = sorted(track_ids)
    random.shuffle(track_ids)
    n_valid = max(1, int(len(track_ids) * valid_frac))
    return track_ids[n_valid:], track_ids[:n_valid]


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class MusicLM(nn.Module):
    def __init__(self, cfg: Cfg):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.ModuleList(nn.Embedding(cfg.card + 1, cfg.dim) for _ in range(cfg.n_q))
        self.genre = nn.Embedding(cfg.n_genres + 1, cfg.dim)  # last index = unconditional
        self.pos = nn.Parameter(torch.zeros(cfg.window + cfg.n_q + 1, cfg.dim))
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.n_heads) for _ in range(cfg.n_layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.out = nn.ModuleList(nn.Linear(cfg.dim, cfg.card, bias=False) for _ in range(cfg.n_q))
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, codes, genre):
        # codes: [B, K, T] already delayed, with special=card
        x = sum(emb(codes[:, k]) for k, emb in enumerate(self.tok))
        x = torch.cat([self.genre(genre)[:, None], x], dim=1)
        x = x + self.pos[: x.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        x = self.ln(x)[:, :-1]
        return torch.stack([head(x) for head in self.out], dim=1)


def delay_and_mask(codes, card):
    """codes [B,K,T] with -1 padding -> delayed tokens, targets (padding -> ignore)."""
    b, k, t = codes.shape
    special = card
    delayed = codes.new_full((b, k, t + k - 1), special)
    for q in range(k):
        delayed[:, q, q : q + t] = codes[:, q]
    target = delayed.clone()
    target[target < 0] = special
    inp = delayed.clamp(min=0)
    inp[delayed < 0] = special
    return inp, target


def cosine_lr(step, base, warmup, total):
    if step < warmup:
        return base * step / warmup
    return base * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


@torch.no_grad()
def validate(model, loader, cfg, device):
    model.eval()
    tot = torch.zeros(2, device=device)
    for codes, genre, _ in loader:
        codes, genre = codes.to(device), genre.to(device)
        inp, target = delay_and_mask(codes, cfg.card)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(inp, genre)
        loss = F.cross_entropy(logits.float().flatten(0, 2), target.flatten(), ignore_index=cfg.card, reduction="sum")
        tot[0] += loss
        tot[1] += (target != cfg.card).sum()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--codes-dir", required=True)
    ap.add_argument("--meta", required=True, help="json: {track_id: genre_index}")
    ap.add_argument("--out", default="/mnt/fsx/exp/music_lm")
    ap.add_argument("--valid-frac", type=float, default=0.01)
    ap.add_argument("--global-batch", type=int, default=192)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--total-steps", type=int, default=400_000)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # different crop / dropout randomness on every rank
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    cfg = Cfg()
    with open(args.meta) as f:
        genres = json.load(f)
    train_ids, valid_ids = split_tracks(list(genres), args.valid_frac)
    train_ds = TrackWindows(args.codes_dir, train_ids, genres, cfg.window)
    valid_ds = TrackWindows(args.codes_dir, valid_ids, genres, cfg.window, train=False)
    bs = args.global_batch // world
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, bs, sampler=train_sampler, num_workers=8, pin_memory=True, drop_last=True)
    valid_dl = DataLoader(Subset(valid_ds, range(rank, len(valid_ds), world)), bs, num_workers=4)

    model = DDP(MusicLM(cfg).to(device), device_ids=[local_rank])
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "pos" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "pos" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=True)

    os.makedirs(args.out, exist_ok=True)
    step, epoch, best = 0, 0, float("inf")
    t_last = time.time()
    while step < args.total_steps:
        train_sampler.set_epoch(epoch)
        for codes, genre, _ in train_dl:
            codes, genre = codes.to(device, non_blocking=True), genre.to(device, non_blocking=True)
            drop = torch.rand(genre.shape, device=device) < cfg.cond_dropout
            genre = torch.where(drop, torch.full_like(genre, cfg.n_genres), genre)
            inp, target = delay_and_mask(codes, cfg.card)

            for g in opt.param_groups:
                g["lr"] = cosine_lr(step, args.lr, args.warmup, args.total_steps)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(inp, genre)
            loss = F.cross_entropy(logits.float().flatten(0, 2), target.flatten(), ignore_index=cfg.card)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1

            if step % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    dt = time.time() - t_last
                    t_last = time.time()
                    print(f"ep {epoch} step {step} loss {l.item():.4f} gnorm {gnorm.item():.2f} "
                          f"{100 * bs * world / dt:.1f} windows/s", flush=True)

            if step % 5000 == 0:
                val = validate(model.module, valid_dl, cfg, device)
                if rank == 0:
                    print(f"step {step} valid_loss {val:.4f} (best {best:.4f})", flush=True)
                    state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                             "step": step, "cfg": cfg.__dict__}
                    torch.save(state, os.path.join(args.out, "last.pt"))
                    if val < best:
                        best = val
                        torch.save(state, os.path.join(args.out, "best.pt"))
                dist.barrier()
            if step >= args.total_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
