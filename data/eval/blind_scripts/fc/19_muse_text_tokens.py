"""Small Muse-style text-conditional masked image-token model (base 256px, VQGAN f16 codes),
conditioned on frozen CLIP ViT-L/14 text embeddings that were precomputed with the token shards.

    torchrun --nproc_per_node=8 19_muse_text_tokens.py --shards '/data/cc3m_tok/shard_*' --out runs/muse_s
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.tensorboard import SummaryWriter


class TokenTextShards(Dataset):
    """Each shard dir: codes.npy (N, 256) uint16, text_emb.npy (N, 77, 768) float16, text_mask.npy (N, 77) bool.
    Arrays are memory-mapped; only the index is built up front."""

    def __init__(self, pattern):
        self.shards = []
        for d in sorted(glob.glob(pattern)):
            self.shards.append(tuple(np.load(os.path.join(d, f"{k}.npy"), mmap_mode="r")
                                     for k in ("codes", "text_emb", "text_mask")))
        self.offsets = np.cumsum([0] + [len(s[0]) for s in self.shards])

    def __len__(self):
        return int(self.offsets[-1])

    def __getitem__(self, i):
        j = int(np.searchsorted(self.offsets, i, side="right") - 1)
        codes, emb, mask = self.shards[j]
        k = i - self.offsets[j]
        return (torch.from_numpy(codes[k].astype(np.int64)),
                torch.from_numpy(emb[k].astype(np.float32)),
                torch.from_numpy(np.array(mask[k], dtype=bool)))


class CrossBlock(nn.Module):
    def __init__(self, d, h, ctx_dim):
        super().__init__()
        self.n1, self.n2, self.n3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.self_attn = nn.MultiheadAttention(d, h, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(d, h, kdim=ctx_dim, vdim=ctx_dim, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, ctx, ctx_pad):
        h = self.n1(x)
        x = x + self.self_attn(h, h, h, need_weights=False)[0]
        x = x + self.cross_attn(self.n2(x), ctx, ctx, key_padding_mask=ctx_pad, need_weights=False)[0]
        return x + self.ff(self.n3(x))


class MuseBase(nn.Module):
    def __init__(self, vocab=8192, seq=256, d=768, depth=16, heads=12, ctx_dim=768):
        super().__init__()
        self.mask_id = vocab
        self.tok = nn.Embedding(vocab + 1, d)
        self.pos = nn.Parameter(torch.zeros(1, seq, d))
        self.ctx_proj = nn.Linear(ctx_dim, ctx_dim)
        self.null_ctx = nn.Parameter(torch.zeros(1, 1, ctx_dim))
        self.blocks = nn.ModuleList([CrossBlock(d, heads, ctx_dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, tokens, ctx, ctx_mask, drop_cond=None):
        ctx = self.ctx_proj(ctx)
        if drop_cond is not None:
            ctx = torch.where(drop_cond[:, None, None], self.null_ctx.expand_as(ctx), ctx)
            ctx_mask = ctx_mask | drop_cond[:, None]
            ctx_mask[:, 0] = True  # keep one valid key for dropped captions
        pad = ~ctx_mask
        x = self.tok(tokens) + self.pos
        for blk in self.blocks:
            x = blk(x, ctx, pad)
        return self.head(self.norm(x))


def mask_tokens(codes, mask_id):
    b, n = codes.shape
    ratio = torch.cos(torch.rand(b, device=codes.device) * math.pi / 2)
    k = (ratio * n).round().clamp(1, n).long()
    rnd = torch.rand(b, n, device=codes.device)
    thresh = rnd.sort(1).values.gather(1, (k - 1)[:, None])
    m = rnd <= thresh
    return codes.masked_fill(m, mask_id), m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5000)
    ap.add_argument("--cond_drop", type=float, default=0.1)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    ds = TokenTextShards(args.shards)
    dl = DataLoader(ds, batch_size=args.bs, shuffle=True, num_workers=8, pin_memory=True, drop_last=True,
                    persistent_workers=True)

    model = DDP(MuseBase().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.96), weight_decay=0.045)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))
    tb = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None

    step = 0
    for epoch in range(args.epochs):
        t0 = time.time()
        for codes, emb, tmask in dl:
            codes = codes.to(device, non_blocking=True)
            emb = emb.to(device, non_blocking=True)
            tmask = tmask.to(device, non_blocking=True)
            inp, m = mask_tokens(codes, model.module.mask_id)
            drop = torch.rand(codes.shape[0], device=device) < args.cond_drop
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(inp, emb, tmask, drop_cond=drop)
            loss = F.cross_entropy(logits.float()[m], codes[m])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if tb is not None:
                    tb.add_scalar("train/loss", l.item(), step)
                    tb.add_scalar("train/lr", sched.get_last_lr()[0], step)
        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s, step {step}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "step": step}, os.path.join(args.out, f"muse_ep{epoch:03d}.pt"))
        dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
