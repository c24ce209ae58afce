"""Melody-conditioned codec language model (MusicGen-melody style, small).

Conditioning: 12-bin chromagram of the reference track, encoded by a small
transformer and prepended as a prefix. Classifier-free guidance dropout during
training so that the model can also be sampled unconditionally.

Data: manifest jsonl with {"codes": path/to/codes.npy [K, T], "chroma": path/to/chroma.npy [12, T']}

    torchrun --nproc_per_node=4 04_melody_cond_codec_lm.py --train_manifest train.jsonl --valid_manifest valid.jsonl
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

K = 4
CARD = 2048
PAD_CODE = CARD  # per-codebook pad / special


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--train_manifest", required=True)
    p.add_argument("--valid_manifest", required=True)
    p.add_argument("--out", default="runs/melody_lm")
    p.add_argument("--frames", type=int, default=500)
    p.add_argument("--chroma_frames", type=int, default=235)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--cond_depth", type=int, default=2)
    p.add_argument("--cfg_dropout", type=float, default=0.2)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=17)
    return p.parse_args()


def read_manifest(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class MelodyCodesDataset(Dataset):
    def __init__(self, items, frames, chroma_frames, train=True):
        self.items, self.frames, self.chroma_frames, self.train = items, frames, chroma_frames, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        codes = np.load(it["codes"], mmap_mode="r")[:K]
        chroma = np.load(it["chroma"], mmap_mode="r")
        T = codes.shape[1]
        start = random.randint(0, max(0, T - self.frames)) if self.train else 0
        c = np.full((K, self.frames), PAD_CODE, dtype=np.int64)
        seg = np.asarray(codes[:, start:start + self.frames])
        c[:, : seg.shape[1]] = seg
        # chroma is at a different frame rate; take the proportional window
        cs = int(start * chroma.shape[1] / max(T, 1))
        ch = np.zeros((12, self.chroma_frames), dtype=np.float32)
        cseg = np.asarray(chroma[:, cs:cs + self.chroma_frames], dtype=np.float32)
        ch[:, : cseg.shape[1]] = cseg
        return torch.from_numpy(c), torch.from_numpy(ch)


def delay_pattern(codes):
    """MusicGen delay interleaving: codebook k is shifted right by k steps."""
    B, Kc, T = codes.shape
    out = torch.full((B, Kc, T + Kc - 1), PAD_CODE, dtype=codes.dtype, device=codes.device)
    for k in range(Kc):
        out[:, k, k:k + T] = codes[:, k]
    return out


class ChromaEncoder(nn.Module):
    def __init__(self, dim, depth, heads):
        super().__init__()
        self.proj = nn.Linear(12, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, 0.1, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)

    def forward(self, chroma):  # [B, 12, T']
        x = chroma.transpose(1, 2)
        x = x / (x.amax(dim=-1, keepdim=True) + 1e-6)
        return self.enc(self.proj(x))


class MelodyCodecLM(nn.Module):
    def __init__(self, dim, depth, heads, cond_depth, max_len, cfg_dropout):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(CARD + 1, dim) for _ in range(K)])
        self.cond = ChromaEncoder(dim, cond_depth, heads)
        self.null_cond = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Embedding(max_len, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, 0.1, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.decoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.heads = nn.ModuleList([nn.Linear(dim, CARD) for _ in range(K)])
        self.cfg_dropout = cfg_dropout

    def forward(self, codes, chroma):
        # codes: [B, K, S] (already delayed); predict position t from positions < t
        B, _, S = codes.shape
        x = sum(self.embs[k](codes[:, k]) for k in range(K))
        if self.training and random.random() < self.cfg_dropout:
            prefix = self.null_cond.expand(B, 1, -1)
        else:
            prefix = self.cond(chroma)
        P = prefix.size(1)
        h = torch.cat([prefix, x], 1)
        h = h + self.pos(torch.arange(h.size(1), device=h.device))[None]
        L = h.size(1)
        mask = torch.triu(torch.ones(L, L, dtype=torch.bool, device=h.device), 1)
        mask[:, :P] = False  # the prefix is fully visible
        h = self.norm(self.decoder(h, mask=mask))
        h = h[:, P - 1:-1]  # states that predict codes positions 0..S-1
        return torch.stack([head(h) for head in self.heads], 1)  # [B, K, S, CARD]


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 2).float(), target.flatten(), ignore_index=PAD_CODE)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for codes, chroma in loader:
        codes = delay_pattern(codes.to(device))
        chroma = chroma.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(codes, chroma)
        valid = (codes != PAD_CODE).sum()
        tot[0] += lm_loss(logits, codes) * valid
        tot[1] += valid
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    train_ds = MelodyCodesDataset(read_manifest(args.train_manifest), args.frames, args.chroma_frames)
    valid_items = read_manifest(args.valid_manifest)
    valid_ds = MelodyCodesDataset(valid_items[rank::world], args.frames, args.chroma_frames, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    valid_dl = DataLoader(valid_ds, batch_size=args.batch_size, num_workers=2)

    max_len = args.chroma_frames + args.frames + K
    net = MelodyCodecLM(args.dim, args.depth, args.heads, args.cond_depth, max_len, args.cfg_dropout).to(device)
    model = DDP(net, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, s / args.warmup) * max(0.0, 0.5 * (1 + math.cos(math.pi * s / total))))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    step = 0
    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        for codes, chroma in train_dl:
            codes = delay_pattern(codes.to(device, non_blocking=True))
            chroma = chroma.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(codes, chroma)
            loss = lm_loss(logits, codes)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if writer is not None and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)
                writer.add_scalar("train/sec_per_step", (time.time() - tic) / 50, step)
                tic = time.time()

        val = evaluate(net, valid_dl, device)
        if rank == 0:
            writer.add_scalar("valid/ce", val, step)
            print(f"epoch {epoch} step {step} valid ce {val:.4f}", flush=True)
            state = {"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "args": vars(args)}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if val < best:
                best = val
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
