"""Megatron-style tensor-parallel GPT training (intra-node TP only).

Attention heads and the MLP hidden dimension are split across all ranks of the
job; the embedding is vocab-parallel. Every rank sees the same batch.

    torchrun --standalone --nproc_per_node=8 03_tp_transformer_lm.py --train /data/c4/train.bin --val /data/c4/val.bin
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
from torch.utils.data import DataLoader, Dataset


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--save-dir", default="runs/tp_gpt")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--lr", type=float, default=1.5e-4)
    ap.add_argument("--min-lr", type=float, default=1.5e-5)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=50000)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-iters", type=int, default=40)
    ap.add_argument("--save-every", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


class BinDataset(Dataset):
    def __init__(self, path, seq_len):
        self.arr = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.arr) - 1) // self.seq_len

    def __getitem__(self, i):
        x = torch.from_numpy(self.arr[i * self.seq_len:(i + 1) * self.seq_len + 1].astype(np.int64))
        return x[:-1], x[1:]


# ---------------------------------------------------------------- TP primitives
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g)
        return g


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        world = dist.get_world_size()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        return g.chunk(dist.get_world_size(), dim=-1)[dist.get_rank()].contiguous()


def _sharded_init(out_f, in_f, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    full = torch.empty(out_f, in_f).normal_(0.0, 0.02, generator=gen)
    return full.chunk(dist.get_world_size(), dim=dim)[dist.get_rank()].clone()


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_f, out_f, seed, gather_output=False, bias=True):
        super().__init__()
        tp = dist.get_world_size()
        assert out_f % tp == 0
        self.gather_output = gather_output
        self.weight = nn.Parameter(_sharded_init(out_f, in_f, 0, seed))
        self.weight.tensor_parallel = True
        self.bias = nn.Parameter(torch.zeros(out_f // tp)) if bias else None
        if bias:
            self.bias.tensor_parallel = True

    def forward(self, x):
        y = F.linear(_CopyToTP.apply(x), self.weight, self.bias)
        return _GatherFromTP.apply(y) if self.gather_output else y


class RowParallelLinear(nn.Module):
    def __init__(self, in_f, out_f, seed, bias=True):
        super().__init__()
        self.weight = nn.Parameter(_sharded_init(out_f, in_f, 1, seed))
        self.weight.tensor_parallel = True
        self.bias = nn.Parameter(torch.zeros(out_f)) if bias else None

    def forward(self, x):
        y = _ReduceFromTP.apply(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab, dim, seed):
        super().__init__()
        tp, r = dist.get_world_size(), dist.get_rank()
        self.per_rank = vocab // tp
        self.start, self.end = r * self.per_rank, (r + 1) * self.per_rank
        self.weight = nn.Parameter(_sharded_init(vocab, dim, 0, seed))
        self.weight.tensor_parallel = True

    def forward(self, ids):
        mask = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(mask, 0)
        out = F.embedding(local, self.weight).masked_fill(mask.unsqueeze(-1), 0.0)
        return _ReduceFromTP.apply(out)


# ---------------------------------------------------------------- model
class ParallelBlock(nn.Module):
    def __init__(self, args, idx):
        super().__init__()
        tp = dist.get_world_size()
        self.local_heads = args.heads // tp
        self.head_dim = args.hidden // args.heads
        base = args.seed * 1000 + idx * 10
        self.ln1 = nn.LayerNorm(args.hidden)
        self.qkv = ColumnParallelLinear(args.hidden, 3 * args.hidden, seed=base + 1)
        self.proj = RowParallelLinear(args.hidden, args.hidden, seed=base + 2)
        self.ln2 = nn.LayerNorm(args.hidden)
        self.fc1 = ColumnParallelLinear(args.hidden, 4 * args.hidden, seed=base + 3)
        self.fc2 = RowParallelLinear(4 * args.hidden, args.hidden, seed=base + 4)

    def forward(self, x):
        B, T, _ = x.shape
        qkv = self.qkv(self.ln1(x)).view(B, T, self.local_heads, 3 * self.head_dim)
        q, k, v = qkv.transpose(1, 2).split(self.head_dim, dim=-1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TPGPT(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed = VocabParallelEmbedding(args.vocab, args.hidden, seed=args.seed)
        self.pos = nn.Parameter(torch.zeros(args.seq_len, args.hidden))
        self.blocks = nn.ModuleList([ParallelBlock(args, i) for i in range(args.layers)])
        self.ln_f = nn.LayerNorm(args.hidden)
        self.head = ColumnParallelLinear(args.hidden, args.vocab, seed=args.seed + 7,
                                         gather_output=True, bias=False)

    def forward(self, ids):
        x = self.embed(ids) + self.pos[: ids.size(1)]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def clip_grad_norm_tp(model, max_norm):
    sharded = torch.zeros(1, device="cuda")
    replicated = torch.zeros(1, device="cuda")
    for p in model.parameters():
        if p.grad is None:
            continue
        sq = p.grad.float().pow(2).sum()
        if getattr(p, "tensor_parallel", False):
            sharded += sq
        else:
            replicated += sq
    dist.all_reduce(sharded)
    total = (sharded + replicated).sqrt()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(scale)
    return total.item()


@torch.no_grad()
def evaluate(model, loader, iters):
    model.eval()
    losses = []
    for i, (x, y) in enumerate(loader):
        if i == iters:
            break
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item())
    model.train()
    return sum(losses) / len(losses)


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    ratio = min(1.0, (step - args.warmup) / (args.steps - args.warmup))
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * ratio))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, tp = dist.get_rank(), dist.get_world_size()
    assert args.heads % tp == 0 and args.vocab % tp == 0

    torch.manual_seed(args.seed)
    model = TPGPT(args).cuda()
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"params per rank: {n / 1e6:.1f}M  (tp={tp})", flush=True)

    # all TP ranks must consume identical batches: same generator seed everywhere
    train_loader = DataLoader(BinDataset(args.train, args.seq_len), batch_size=args.batch_size,
                              shuffle=True, generator=torch.Generator().manual_seed(args.seed),
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(BinDataset(args.val, args.seq_len), batch_size=args.batch_size,
                            shuffle=False, num_workers=2, pin_memory=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=True)
    os.makedirs(args.save_dir, exist_ok=True)

    step = 0
    train_iter = iter(train_loader)
    t0 = time.time()
    while step < args.steps:
        try:
            x, y = next(train_iter)
        except StopIteration:
            train_iter = iter(train_loader)
            x, y = next(train_iter)
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)

        for g in optimizer.param_groups:
            g["lr"] = lr_at(step, args)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = clip_grad_norm_tp(model, args.grad_clip)
        optimizer.step()
        step += 1

        if rank == 0 and step % 10 == 0:
            dt = (time.time() - t0) / 10
            t0 = time.time()
            print(f"step {step:6d} loss {loss.item():.4f} gnorm {gnorm:.3f} "
                  f"lr {lr_at(step, args):.2e} {dt:.2f}s/it", flush=True)

        if step % args.eval_every == 0 and rank == 0:
            val_loss = evaluate(model, val_loader, args.eval_iters)
            print(f"step {step:6d} val_loss {val_loss:.4f} val_ppl {math.exp(val_loss):.1f}", flush=True)

        if step % args.save_every == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step, "tp_size": tp},
                       os.path.join(args.save_dir, f"step{step:07d}_mp_rank_{rank:02d}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
