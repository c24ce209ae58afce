"""Packed-document long-context LM training (Ulysses SP + flash-attn varlen).

Each 128k-token training row packs several documents; attention is restricted to
tokens of the same document via cu_seqlens. Tokens are sharded over the SP group
and gathered per head group with all_to_all before the varlen kernel.

    torchrun --nproc_per_node=8 14_packed_docs_ulysses_varlen.py --sp 8 --data /shared/packed128k
"""
import argparse
import math
import os
import time
from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from flash_attn import flash_attn_varlen_func
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


@dataclass
class Config:
    data: str = "/shared/packed128k"
    out: str = "/shared/runs/packed128k"
    device: str = "cuda:0"
    sp: int = 8
    seq_len: int = 131072
    vocab: int = 128256
    dim: int = 2048
    layers: int = 16
    heads: int = 32
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup: int = 300
    steps: int = 15000
    log_every: int = 10
    save_every: int = 1000
    seed: int = 11


def parse() -> Config:
    ap = argparse.ArgumentParser()
    for f in fields(Config):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    return Config(**vars(ap.parse_args()))


def _a2a(x, group, scatter_dim, gather_dim):
    n = dist.get_world_size(group)
    xs = [t.contiguous() for t in torch.tensor_split(x, n, scatter_dim)]
    ys = [torch.empty_like(xs[0]) for _ in range(n)]
    dist.all_to_all(ys, xs, group=group)
    return torch.cat(ys, gather_dim)


class SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.save = (group, scatter_dim, gather_dim)
        return _a2a(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, g):
        group, s, gd = ctx.save
        return _a2a(g, group, gd, s), None, None, None


class Attn(nn.Module):
    def __init__(self, dim, heads, group):
        super().__init__()
        self.h, self.group = heads, group
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin, cu, max_len):
        s, d = x.shape  # batch of 1 row, flattened
        q, k, v = self.qkv(x).view(s, 3, self.h, d // self.h).unbind(1)
        q = q * cos + torch.cat([-q[..., q.size(-1) // 2:], q[..., : q.size(-1) // 2]], -1) * sin
        k = k * cos + torch.cat([-k[..., k.size(-1) // 2:], k[..., : k.size(-1) // 2]], -1) * sin
        q, k, v = (SeqAllToAll.apply(t.to(torch.bfloat16), self.group, 1, 0) for t in (q, k, v))
        out = flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True)
        out = SeqAllToAll.apply(out, self.group, 0, 1)
        return self.o(out.reshape(s, d))


class Layer(nn.Module):
    def __init__(self, dim, heads, group):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = Attn(dim, heads, group)
        self.up = nn.Linear(dim, 2 * 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x, *attn_args):
        x = x + self.attn(self.n1(x), *attn_args)
        a, b = self.up(self.n2(x)).chunk(2, -1)
        return x + self.down(F.silu(a) * b)


class PackedLM(nn.Module):
    def __init__(self, cfg, group):
        super().__init__()
        self.emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Layer(cfg.dim, cfg.heads, group) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, ids, cos, sin, cu, max_len):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x, cos, sin, cu, max_len)
        return self.head(self.norm(x))


class PackedRows(Dataset):
    """rows.npy: [n, seq_len + 1] token ids; docpos.npy: [n, seq_len + 1] position inside the document."""

    def __init__(self, root):
        self.rows = np.load(os.path.join(root, "rows.npy"), mmap_mode="r")
        self.docpos = np.load(os.path.join(root, "docpos.npy"), mmap_mode="r")

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return torch.from_numpy(self.rows[i].astype(np.int64)), torch.from_numpy(self.docpos[i].astype(np.int64))


def doc_boundaries(docpos):
    """cu_seqlens (int32) of the documents in one packed row, from per-token document positions."""
    starts = torch.nonzero(docpos == 0).flatten()
    if starts.numel() == 0 or starts[0] != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    cu = torch.cat([starts, starts.new_tensor([docpos.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def main():
    cfg = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(cfg.device)

    sp_group = None
    for s0 in range(0, world, cfg.sp):
        g = dist.new_group(list(range(s0, s0 + cfg.sp)))
        if s0 <= rank < s0 + cfg.sp:
            sp_group = g
    sp_rank, dp_rank, dp_size = rank % cfg.sp, rank // cfg.sp, world // cfg.sp
    L = cfg.seq_len // cfg.sp
    hd = cfg.dim // cfg.heads
    inv = 1.0 / 500000.0 ** (torch.arange(0, hd, 2, device=device).float() / hd)

    torch.manual_seed(cfg.seed)
    model = PackedLM(cfg, sp_group).to(device)
    model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    ds = PackedRows(cfg.data)
    sampler = DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=cfg.seed)
    loader = DataLoader(ds, batch_size=1, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)

    def lr_at(it):
        if it < cfg.warmup:
            return cfg.lr * (it + 1) / cfg.warmup
        r = min(1.0, (it - cfg.warmup) / (cfg.steps - cfg.warmup))
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * r))

    step, epoch, tic = 0, 0, time.time()
    while step < cfg.steps:
        sampler.set_epoch(epoch)
        for row, docpos in loader:
            row, docpos = row[0].to(device, non_blocking=True), docpos[0].to(device, non_blocking=True)
            inp, tgt, pos = row[:-1], row[1:], docpos[:-1]
            # boundaries are computed on the full row: after the all-to-all each rank attends over all tokens
            cu, max_len = doc_boundaries(pos)
            sl = slice(sp_rank * L, (sp_rank + 1) * L)
            ang = torch.outer(pos[sl].float(), inv)
            ang = torch.cat([ang, ang], -1)
            cos, sin = ang.cos()[:, None], ang.sin()[:, None]
            # do not train across document boundaries
            tgt = tgt.masked_fill(docpos[1:] == 0, -100)

            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(inp[sl], cos, sin, cu, max_len)
            loss = F.cross_entropy(logits.float(), tgt[sl], ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1

            if step % cfg.log_every == 0:
                lt = loss.detach()
                dist.all_reduce(lt, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {lt.item():.4f} lr {lr_at(step):.2e} "
                          f"{(time.time() - tic) / cfg.log_every:.2f}s/it", flush=True)
                tic = time.time()
            if step % cfg.save_every == 0:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                               os.path.join(cfg.out, f"step{step}.pt"))
                dist.barrier()
            if step >= cfg.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
