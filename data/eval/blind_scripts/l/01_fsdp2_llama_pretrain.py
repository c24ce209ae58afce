#!/usr/bin/env python
# Small llama-style decoder pretraining on pre-tokenized uint16 shards, FSDP2.
#
#   torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
#       --rdzv_endpoint=$HEAD_NODE:29400 --rdzv_id=pt-350m \
#       01_fsdp2_llama_pretrain.py --data /mnt/data/fineweb_edu_tok --out /mnt/ckpt/pt-350m

import argparse
import glob
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


@dataclass
class ModelArgs:
    vocab_size: int = 50304
    dim: int = 1024
    n_layers: int = 24
    n_heads: int = 16
    max_seq_len: int = 2048
    ffn_mult: float = 2.6667
    norm_eps: float = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads = a.n_heads
        self.head_dim = a.dim // a.n_heads
        self.wqkv = nn.Linear(a.dim, 3 * a.dim, bias=False)
        self.wo = nn.Linear(a.dim, a.dim, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.wqkv(x).split(C, dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class FeedForward(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        hidden = int(a.ffn_mult * a.dim)
        hidden = 256 * ((hidden + 255) // 256)
        self.w1 = nn.Linear(a.dim, hidden, bias=False)
        self.w3 = nn.Linear(a.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, a.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attn_norm = RMSNorm(a.dim, a.norm_eps)
        self.attn = Attention(a)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.ffn = FeedForward(a)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.tok_emb = nn.Embedding(a.vocab_size, a.dim)
        self.pos_emb = nn.Embedding(a.max_seq_len, a.dim)
        self.layers = nn.ModuleList([Block(a) for _ in range(a.n_layers)])
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        self.apply(self._init)

    def _init(self, m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx):
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        h = self.tok_emb(idx) + self.pos_emb(pos)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


class TokenShards:
    """Random windows from memory-mapped .bin shards (uint16)."""

    def __init__(self, data_dir, seq_len, seed):
        self.files = sorted(glob.glob(os.path.join(data_dir, "*.bin")))
        assert self.files, f"no shards in {data_dir}"
        self.maps = [np.memmap(f, dtype=np.uint16, mode="r") for f in self.files]
        self.sizes = np.array([len(m) for m in self.maps], dtype=np.float64)
        self.probs = self.sizes / self.sizes.sum()
        self.seq_len = seq_len
        self.rng = np.random.default_rng(seed)

    def batch(self, bsz):
        xs, ys = [], []
        for _ in range(bsz):
            s = self.rng.choice(len(self.maps), p=self.probs)
            m = self.maps[s]
            i = self.rng.integers(0, len(m) - self.seq_len - 1)
            chunk = torch.from_numpy(m[i : i + self.seq_len + 1].astype(np.int64))
            xs.append(chunk[:-1])
            ys.append(chunk[1:])
        return torch.stack(xs), torch.stack(ys)


def get_lr(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    prog = (step - args.warmup) / max(1, args.max_steps - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(prog, 1.0)))


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="./ckpt")
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--micro_bsz", type=int, default=8)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--min_lr", type=float, default=3e-5)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--max_steps", type=int, default=60000)
    p.add_argument("--save_every", type=int, default=2000)
    p.add_argument("--log_every", type=int, default=20)
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))
    is_master = rank == 0

    torch.manual_seed(args.seed)
    margs = ModelArgs(max_seq_len=args.seq_len)
    with torch.device("cuda"):
        model = Transformer(margs)

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)

    n_params = sum(p.numel() for p in model.parameters())
    if is_master:
        print(f"params (sharded view): {n_params / 1e6:.1f}M, world={world}", flush=True)

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                              weight_decay=0.1, fused=True)
    data = TokenShards(args.data, args.seq_len, seed=args.seed + rank)
    os.makedirs(args.out, exist_ok=True)

    model.train()
    t0 = time.time()
    for step in range(args.max_steps):
        lr = get_lr(step, args)
        for g in optim.param_groups:
            g["lr"] = lr

        loss_acc = torch.zeros((), device="cuda")
        for micro in range(args.grad_accum):
            x, y = data.batch(args.micro_bsz)
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            model.set_requires_gradient_sync(micro == args.grad_accum - 1)
            logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
            (loss / args.grad_accum).backward()
            loss_acc += loss.detach() / args.grad_accum

        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)

        if step % args.log_every == 0:
            dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)
            if is_master:
                dt = (time.time() - t0) / args.log_every
                tok_s = args.micro_bsz * args.grad_accum * args.seq_len * world / dt
                print(f"step {step} loss {loss_acc.item():.4f} lr {lr:.2e} "
                      f"gnorm {gnorm.full_tensor().item():.3f} tok/s {tok_s:,.0f}", flush=True)
            t0 = time.time()

        if step > 0 and step % args.save_every == 0:
            if is_master:
                sd = get_model_state_dict(
                    model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
                )
                torch.save(sd, os.path.join(args.out, f"model_{step:07d}.pt"))
                print(f"saved step {step}", flush=True)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
