#!/usr/bin/env python
"""Long-context causal LM pretraining with Ulysses-style sequence parallelism.

Every sequence is split along the time axis over an SP group of `--sp-size`
ranks. Inside attention the shards are exchanged with all_to_all so that each
rank sees the full sequence for H / sp_size heads, then exchanged back.
Data parallelism runs across SP groups.

    torchrun --nproc_per_node=8 01_ulysses_lm_pretrain.py --sp-size 4 \
        --data /mnt/shared/tokens/pile_32k --out /mnt/shared/runs/ulysses_1b
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
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--sp-size", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--n-layers", type=int, default=16)
    p.add_argument("--n-heads", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=1, help="sequences per SP group")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--min-lr", type=float, default=3e-5)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--max-steps", type=int, default=20000)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--eval-batches", type=int, default=50)
    p.add_argument("--save-every", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


# ----------------------------------------------------------------------------
# sequence parallel primitives
# ----------------------------------------------------------------------------

def _all_to_all(x, group, scatter_dim, gather_dim):
    world = dist.get_world_size(group)
    inputs = [t.contiguous() for t in torch.tensor_split(x, world, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(world)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim).contiguous()


class SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group = group
        ctx.scatter_dim = scatter_dim
        ctx.gather_dim = gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def rope_cache(seq_len, head_dim, base=10000.0, device=None):
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    t = torch.arange(seq_len, device=device).float()
    freqs = torch.outer(t, inv)
    return freqs.cos(), freqs.sin()


def apply_rope(x, cos, sin):
    # x: [B, S, H, D]; cos/sin: [S, D/2]
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class UlyssesAttention(nn.Module):
    def __init__(self, dim, n_heads, sp_group):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.sp_group = sp_group
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        B, S, C = x.shape  # S is the local shard length
        q, k, v = self.qkv(x).view(B, S, 3, self.n_heads, self.head_dim).unbind(2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # [B, S/P, H, D] -> [B, S, H/P, D]
        q = SeqAllToAll.apply(q, self.sp_group, 2, 1)
        k = SeqAllToAll.apply(k, self.sp_group, 2, 1)
        v = SeqAllToAll.apply(v, self.sp_group, 2, 1)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        ).transpose(1, 2)
        # [B, S, H/P, D] -> [B, S/P, H, D]
        o = SeqAllToAll.apply(o, self.sp_group, 1, 2)
        return self.proj(o.reshape(B, S, C))


class Block(nn.Module):
    def __init__(self, dim, n_heads, sp_group):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = UlyssesAttention(dim, n_heads, sp_group)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x, cos, sin):
        x = x + self.attn(self.ln1(x), cos, sin)
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    def __init__(self, args, sp_group):
        super().__init__()
        self.tok = nn.Embedding(args.vocab_size, args.dim)
        self.blocks = nn.ModuleList(Block(args.dim, args.n_heads, sp_group) for _ in range(args.n_layers))
        self.ln_f = nn.LayerNorm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx, cos, sin):
        x = self.tok(idx)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        return self.head(self.ln_f(x))


# ----------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------

class TokenWindows(Dataset):
    """Fixed windows of seq_len + 1 tokens from a flat uint16 token file."""

    def __init__(self, path, seq_len):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len
        self.n = (len(self.tokens) - 1) // seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        start = i * self.seq_len
        chunk = torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    ratio = (step - args.warmup) / max(1, args.max_steps - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, ratio)))


def shard(x, sp_rank, sp_size):
    n = x.size(1) // sp_size
    return x[:, sp_rank * n:(sp_rank + 1) * n]


@torch.no_grad()
def evaluate(model, loader, cos, sin, sp_rank, sp_size, n_batches):
    model.eval()
    total, count = 0.0, 0
    for i, (x, y) in enumerate(loader):
        if i >= n_batches:
            break
        x = shard(x.cuda(non_blocking=True), sp_rank, sp_size)
        y = shard(y.cuda(non_blocking=True), sp_rank, sp_size)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x, cos, sin)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        total += loss.item()
        count += 1
    model.train()
    return total / max(count, 1)


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    assert world % args.sp_size == 0, "world size must be a multiple of sp size"
    assert args.seq_len % args.sp_size == 0 and args.n_heads % args.sp_size == 0

    # SP groups are blocks of consecutive ranks (same node), DP groups are strided
    sp_group = None
    for i in range(world // args.sp_size):
        ranks = list(range(i * args.sp_size, (i + 1) * args.sp_size))
        g = dist.new_group(ranks)
        if rank in ranks:
            sp_group = g
    sp_rank = rank % args.sp_size
    dp_rank, dp_size = rank // args.sp_size, world // args.sp_size

    torch.manual_seed(args.seed)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    model = LM(args, sp_group).cuda()
    model = DDP(model, device_ids=[local_rank])
    n_params = sum(p.numel() for p in model.parameters())

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=True,
    )

    train_ds = TokenWindows(os.path.join(args.data, "train.bin"), args.seq_len)
    val_ds = TokenWindows(os.path.join(args.data, "val.bin"), args.seq_len)
    # all ranks of one SP group must read the same sequence -> sample over DP ranks
    train_sampler = DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, num_replicas=dp_size, rank=dp_rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, num_workers=2, pin_memory=True)

    cos, sin = rope_cache(args.seq_len, args.dim // args.n_heads, device="cuda")
    local = args.seq_len // args.sp_size
    cos, sin = cos[sp_rank * local:(sp_rank + 1) * local], sin[sp_rank * local:(sp_rank + 1) * local]

    if rank == 0:
        print(f"world={world} sp={args.sp_size} dp={dp_size} params={n_params / 1e6:.1f}M", flush=True)

    step, epoch = 0, 0
    t0 = time.time()
    while step < args.max_steps:
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            x = shard(x.cuda(non_blocking=True), sp_rank, args.sp_size)
            y = shard(y.cuda(non_blocking=True), sp_rank, args.sp_size)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args)

            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x, cos, sin)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1

            if step % 20 == 0:
                lt = loss.detach()
                dist.all_reduce(lt, op=dist.ReduceOp.AVG)
                if rank == 0:
                    tok_s = 20 * args.batch_size * dp_size * args.seq_len / (time.time() - t0)
                    print(f"step {step} loss {lt.item():.4f} gnorm {gnorm.item():.2f} "
                          f"lr {lr_at(step, args):.2e} tok/s {tok_s:.0f}", flush=True)
                    t0 = time.time()

            if step % args.eval_every == 0:
                val_loss = evaluate(model, val_loader, cos, sin, sp_rank, args.sp_size, args.eval_batches)
                if rank == 0:
                    print(f"step {step} val_loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}", flush=True)

            if step % args.save_every == 0:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "step": step, "args": vars(args)},
                               os.path.join(args.out, f"step_{step:07d}.pt"))
                dist.barrier()

            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
