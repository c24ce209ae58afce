"""Preemptible GPT pretraining with FSDP + per-rank sharded checkpoints.

Each rank writes its own shard (fast, no gather on rank 0), and the data loader position is
saved with it so a restarted job continues on the next unseen batch.

    torchrun --nnodes=$NNODES --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        07_gpt_fsdp_sharded_resume.py --data /fsx/tokens/slimpajama --ckpt_dir /fsx/ckpt/gpt-760m
"""
import argparse
import functools
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy


class DecoderLayer(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, 4 * dim, bias=False)
        self.w2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        qkv = self.wqkv(self.norm1(x)).view(B, T, 3, self.n_heads, D // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(B, T, D))
        return x + self.w2(F.gelu(self.w1(self.norm2(x))))


class Decoder(nn.Module):
    def __init__(self, vocab, dim, n_layers, n_heads, max_len):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, max_len, dim))
        self.layers = nn.ModuleList(DecoderLayer(dim, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        nn.init.normal_(self.pos, std=0.01)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[:, : tokens.size(1)]
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))


class ShardStream:
    """Sequential reader over token shards; shard i goes to rank i % world."""

    def __init__(self, root, seq_len, batch, rank, world):
        self.files = sorted(glob.glob(os.path.join(root, "*.bin")))[rank::world]
        self.seq_len, self.batch = seq_len, batch
        self.file_idx, self.pos = 0, 0
        self._open()

    def _open(self):
        self.arr = np.memmap(self.files[self.file_idx % len(self.files)], dtype=np.uint16, mode="r")

    def next(self):
        n = self.batch * self.seq_len + 1
        if self.pos + n > len(self.arr):
            self.file_idx += 1
            self.pos = 0
            self._open()
        chunk = torch.from_numpy(self.arr[self.pos:self.pos + n].astype(np.int64))
        self.pos += self.batch * self.seq_len
        x = chunk[:-1].view(self.batch, self.seq_len)
        y = chunk[1:].view(self.batch, self.seq_len)
        return x, y

    def state_dict(self):
        return {"file_idx": self.file_idx, "pos": self.pos}

    def load_state_dict(self, sd):
        self.file_idx, self.pos = sd["file_idx"], sd["pos"]
        self._open()


def cosine(step, warmup, total, peak, floor):
    if step < warmup:
        return peak * step / warmup
    t = min(1.0, (step - warmup) / (total - warmup))
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * t))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--ckpt_dir", required=True)
    ap.add_argument("--dim", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200000)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--ckpt_every", type=int, default=1000)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    torch.manual_seed(0)

    model = Decoder(args.vocab, args.dim, args.layers, args.heads, args.seq_len)
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                           transformer_layer_cls={DecoderLayer}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=local_rank,
        limit_all_gathers=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    stream = ShardStream(args.data, args.seq_len, args.batch, rank, world)

    step = 0
    latest = os.path.join(args.ckpt_dir, "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            tag = f.read().strip()
        shard = torch.load(os.path.join(args.ckpt_dir, tag, f"rank{rank:04d}.pt"),
                           map_location=f"cuda:{local_rank}")
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            model.load_state_dict(shard["model"])
        opt.load_state_dict(shard["optim"])
        stream.load_state_dict(shard["data"])
        step = shard["step"]
        if rank == 0:
            print(f"resuming from {tag} at step {step}")
        del shard

    tok_per_step = args.batch * args.seq_len * world
    t0 = time.time()
    while step < args.steps:
        lr = cosine(step, args.warmup, args.steps, args.lr, args.lr * 0.1)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = stream.next()
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, args.vocab), y.view(-1))
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        if step % 50 == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                dt = (time.time() - t0) / 50
                print(f"step {step} loss {l.item():.3f} lr {lr:.2e} {tok_per_step / dt / 1e3:.0f}k tok/s",
                      flush=True)
            t0 = time.time()

        if step % args.ckpt_every == 0:
            tag = f"step{step:08d}"
            os.makedirs(os.path.join(args.ckpt_dir, tag), exist_ok=True)
            with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
                sd = model.state_dict()
            torch.save({"model": sd, "optim": opt.state_dict(), "data": stream.state_dict(),
                        "step": step}, os.path.join(args.ckpt_dir, tag, f"rank{rank:04d}.pt"))
            dist.barrier()
            if rank == 0:
                with open(latest + ".tmp", "w") as f:
                    f.write(tag)
                os.replace(latest + ".tmp", latest)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
