"""Melody -> full accompaniment generation with long contexts (up to 8k accompaniment tokens).

Encoder reads the lead-sheet melody (REMI tokens), decoder generates the accompaniment
with cross-attention. Every `--uncond_every`-th step is trained without the melody
(memory dropped) so the decoder also works as an unconditional continuation model.
Activation checkpointing on the decoder blocks keeps 8k-token sequences in memory.

    torchrun --nproc_per_node=8 15_long_context_accomp.py --data /data/accomp_pairs --out runs/accomp_8k
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

PAD, BOS, EOS = 0, 1, 2


class PairDataset(Dataset):
    """Each .npz holds 'melody' and 'accomp' int16 token arrays for one song."""

    def __init__(self, files, mel_len, acc_len):
        self.files, self.mel_len, self.acc_len = files, mel_len, acc_len

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        mel = np.concatenate([[BOS], d["melody"][: self.mel_len - 2], [EOS]]).astype(np.int64)
        acc = np.concatenate([[BOS], d["accomp"][: self.acc_len - 1], [EOS]]).astype(np.int64)
        m = np.full(self.mel_len, PAD, np.int64)
        a = np.full(self.acc_len + 1, PAD, np.int64)
        m[:len(mel)] = mel
        a[:len(acc)] = acc
        return torch.from_numpy(m), torch.from_numpy(a)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.h = heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x, ctx=None, causal=False, key_pad=None):
        B, T, C = x.shape
        ctx = x if ctx is None else ctx
        q = self.q(x).view(B, T, self.h, -1).transpose(1, 2)
        k, v = self.kv(ctx).view(B, ctx.size(1), 2, self.h, -1).permute(2, 0, 3, 1, 4)
        mask = None
        if key_pad is not None:
            mask = ~key_pad[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class EncoderBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, key_pad):
        x = x + self.attn(self.n1(x), key_pad=key_pad)
        return x + self.ff(self.n2(x))


class DecoderBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.n1, self.n2, self.n3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.self_attn = Attention(dim, heads)
        self.cross_attn = Attention(dim, heads)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, memory=None, mem_pad=None):
        x = x + self.self_attn(self.n1(x), causal=True)
        if memory is not None:
            x = x + self.cross_attn(self.n2(x), ctx=memory, key_pad=mem_pad)
        return x + self.ff(self.n3(x))


class Accompanist(nn.Module):
    def __init__(self, vocab, dim=768, enc_layers=6, dec_layers=16, heads=12, mel_len=2048, acc_len=8192,
                 grad_ckpt=True):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.mel_pos = nn.Embedding(mel_len, dim)
        self.acc_pos = nn.Embedding(acc_len, dim)
        self.encoder = nn.ModuleList(EncoderBlock(dim, heads) for _ in range(enc_layers))
        self.decoder = nn.ModuleList(DecoderBlock(dim, heads) for _ in range(dec_layers))
        self.enc_norm, self.dec_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.grad_ckpt = grad_ckpt

    def encode(self, mel):
        pad = mel == PAD
        h = self.emb(mel) + self.mel_pos(torch.arange(mel.size(1), device=mel.device))
        for blk in self.encoder:
            h = blk(h, pad)
        return self.enc_norm(h), pad

    def forward(self, mel, acc_in, use_melody=True):
        memory, mem_pad = self.encode(mel) if use_melody else (None, None)
        h = self.emb(acc_in) + self.acc_pos(torch.arange(acc_in.size(1), device=acc_in.device))
        for blk in self.decoder:
            if self.grad_ckpt and self.training:
                h = checkpoint(blk, h, memory, mem_pad, use_reentrant=True)
            else:
                h = blk(h, memory, mem_pad)
        return self.head(self.dec_norm(h))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)
    for mel, acc in loader:
        mel, acc = mel.to(device), acc.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(mel, acc[:, :-1])
        s[0] += F.cross_entropy(logits.float().transpose(1, 2), acc[:, 1:], ignore_index=PAD, reduction="sum")
        s[1] += (acc[:, 1:] != PAD).sum()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=700)
    ap.add_argument("--mel_len", type=int, default=2048)
    ap.add_argument("--acc_len", type=int, default=8192)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--uncond_every", type=int, default=5)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    files = sorted(glob.glob(os.path.join(args.data, "*.npz")))
    val_files, train_files = files[:200], files[200:]
    train_ds = PairDataset(train_files, args.mel_len, args.acc_len)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(PairDataset(val_files[rank::world], args.mel_len, args.acc_len), args.bs, num_workers=2)

    net = Accompanist(args.vocab, mel_len=args.mel_len, acc_len=args.acc_len).to(device)
    # the melody encoder and cross-attention are skipped on unconditional steps
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    updates = args.epochs * len(train_dl) // args.accum
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / updates))))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    micro, update = 0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        for mel, acc in train_dl:
            mel, acc = mel.to(device, non_blocking=True), acc.to(device, non_blocking=True)
            # same decision on every rank: depends only on the global update counter
            use_melody = (update % args.uncond_every) != 0
            last_micro = (micro + 1) % args.accum == 0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(mel, acc[:, :-1], use_melody=use_melody)
            loss = F.cross_entropy(logits.float().transpose(1, 2), acc[:, 1:], ignore_index=PAD)
            (loss / args.accum).backward()
            micro += 1
            if not last_micro:
                continue
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            update += 1
            if rank == 0 and update % 20 == 0:
                print(f"ep {epoch} upd {update}/{updates} loss {loss.item():.4f} "
                      f"{(time.time() - tic) / 20:.2f}s/upd mem {torch.cuda.max_memory_allocated() / 2**30:.1f}G",
                      flush=True)
                tic = time.time()

        v = evaluate(net, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} val loss {v:.4f}", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "update": update},
                       os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
