"""
Small Llama-style LM (RMSNorm, RoPE, SwiGLU, GQA) pretrained with DDP on a
packed, pre-tokenized corpus. An optional multi-token-prediction head (predict
t+2 from the trunk) can be switched on with --mtp_weight > 0; it is always
built so that checkpoints have the same keys either way. Blocks are
recomputed in backward (activation checkpointing) to fit seq_len 4096.

    torchrun --nnodes=1 --nproc_per_node=8 10_llama_mtp_pretrain.py \
        --data /data/slimpajama_6b_llama_tok.npy --out ckpt/llama_300m --mtp_weight 0.0
"""
import argparse
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
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Packed(Dataset):
    def __init__(self, path, seq_len):
        self.data = np.load(path, mmap_mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i):
        s = i * self.seq_len
        chunk = torch.from_numpy(self.data[s: s + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rope(x, cos, sin):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


class Block(nn.Module):
    def __init__(self, d, n_heads, n_kv, ffn):
        super().__init__()
        self.nh, self.nkv, self.hd = n_heads, n_kv, d // n_heads
        self.attn_norm, self.ffn_norm = RMSNorm(d), RMSNorm(d)
        self.wq = nn.Linear(d, d, bias=False)
        self.wkv = nn.Linear(d, 2 * n_kv * self.hd, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.w13 = nn.Linear(d, 2 * ffn, bias=False)
        self.w2 = nn.Linear(ffn, d, bias=False)

    def forward(self, x, cos, sin):
        B, T, D = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(B, T, self.nh, self.hd)
        k, v = self.wkv(h).view(B, T, 2, self.nkv, self.hd).unbind(2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).reshape(B, T, D))
        g, u = self.w13(self.ffn_norm(x)).chunk(2, -1)
        return x + self.w2(F.silu(g) * u)


class LM(nn.Module):
    def __init__(self, vocab=32000, d=1024, layers=20, heads=16, kv=4, ffn=2816, max_len=4096, grad_ckpt=True):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, heads, kv, ffn) for _ in range(layers)])
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.mtp_proj = nn.Linear(2 * d, d, bias=False)
        self.mtp_block = Block(d, heads, kv, ffn)
        self.mtp_norm = RMSNorm(d)
        self.grad_ckpt = grad_ckpt
        hd = d // heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(max_len).float(), inv)
        self.register_buffer("cos", ang.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", ang.sin()[None, :, None, :], persistent=False)
        for n, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * layers) if n.endswith(("wo.weight", "w2.weight")) else 1))

    def forward(self, idx, use_mtp=False):
        T = idx.shape[1]
        cos, sin = self.cos[:, :T], self.sin[:, :T]
        x = self.embed(idx)
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x, cos, sin, use_reentrant=True)
            else:
                x = blk(x, cos, sin)
        logits = self.head(self.norm(x))
        mtp_logits = None
        if use_mtp:
            nxt = self.embed(idx.roll(-1, dims=1))
            h = self.mtp_proj(torch.cat([self.norm(x), nxt], -1))
            mtp_logits = self.head(self.mtp_norm(self.mtp_block(h, cos, sin)))
        return logits, mtp_logits


def cosine(step, warmup, total, lr, min_lr):
    if step < warmup:
        return lr * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * p))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="ckpt/llama_300m")
    ap.add_argument("--seq_len", type=int, default=4096)
    ap.add_argument("--micro_bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min_lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--mtp_weight", type=float, default=0.0)
    ap.add_argument("--save_every", type=int, default=2000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    ds = Packed(args.data, args.seq_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=17, drop_last=True)
    dl = DataLoader(ds, batch_size=args.micro_bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    torch.manual_seed(17)
    model = LM(max_len=args.seq_len).to(dev)
    use_mtp = args.mtp_weight > 0
    # the MTP branch only takes part in the loss when enabled
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    total = len(dl) * args.epochs

    step = 0
    os.makedirs(args.out, exist_ok=True)
    resume = os.path.join(args.out, "last.pt")
    if os.path.exists(resume):
        sd = torch.load(resume, map_location=dev)
        model.module.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
        step = sd["step"]

    t0 = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(dl):
            if epoch * len(dl) + i < step:
                continue
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            lr = cosine(step, args.warmup, total, args.lr, args.min_lr)
            for g in opt.param_groups:
                g["lr"] = lr
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, mtp_logits = model(x, use_mtp=use_mtp)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                if use_mtp:
                    y2 = y.roll(-1, dims=1)
                    y2[:, -1] = -100
                    loss = loss + args.mtp_weight * F.cross_entropy(mtp_logits.float().flatten(0, 1), y2.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1

            if step % 20 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    tps = 20 * args.micro_bs * args.seq_len * world / (time.time() - t0)
                    t0 = time.time()
                    print(f"ep {epoch} step {step}/{total} loss {l.item():.4f} gn {gn.item():.2f} "
                          f"lr {lr:.2e} tok/s {tps:,.0f}", flush=True)
            if step % args.save_every == 0:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                               resume + ".tmp")
                    os.replace(resume + ".tmp", resume)
                dist.barrier()

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(args.out, "final_model.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
