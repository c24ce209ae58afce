#!/usr/bin/env python3
"""
Small GPT pre-training on a pre-tokenised corpus (train.bin / val.bin, uint16),
sharded with FSDP. Started as a single-GPU nanoGPT-style script.

Launch:
    torchrun --standalone --nproc_per_node=8 02_gpt_pretrain_fsdp.py --data-dir data/openwebtext
"""
import argparse
import functools
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import (
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="data/openwebtext")
    p.add_argument("--out-dir", default="out/gpt_fsdp")
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--micro-batch", type=int, default=12)
    p.add_argument("--grad-accum", type=int, default=5)
    p.add_argument("--max-iters", type=int, default=60000)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min-lr", type=float, default=6e-5)
    p.add_argument("--warmup-iters", type=int, default=2000)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-interval", type=int, default=1000)
    p.add_argument("--eval-iters", type=int, default=100)
    p.add_argument("--log-interval", type=int, default=20)
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args()


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    return dist.get_rank(), local_rank, dist.get_world_size()


def cleanup():
    dist.barrier()
    dist.destroy_process_group()


def is_main_process():
    return dist.get_rank() == 0


def print0(*a, **kw):
    if is_main_process():
        print(*a, **kw, flush=True)


# ---------------------------------------------------------------- model
class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


# ---------------------------------------------------------------- data
class BinLoader:
    """Random contiguous windows from a uint16 token file (nanoGPT style)."""

    def __init__(self, path, block_size, batch_size, device, seed):
        self.path = path
        self.block_size = block_size
        self.batch_size = batch_size
        self.device = device
        self.gen = torch.Generator().manual_seed(seed)

    def next_batch(self):
        data = np.memmap(self.path, dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - self.block_size - 1, (self.batch_size,), generator=self.gen)
        x = torch.stack([torch.from_numpy(data[i:i + self.block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + self.block_size].astype(np.int64)) for i in ix])
        return (x.pin_memory().to(self.device, non_blocking=True),
                y.pin_memory().to(self.device, non_blocking=True))


def get_lr(it, args):
    if it < args.warmup_iters:
        return args.lr * (it + 1) / args.warmup_iters
    if it > args.max_iters:
        return args.min_lr
    ratio = (it - args.warmup_iters) / (args.max_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


@torch.no_grad()
def estimate_loss(model, loaders, eval_iters, device):
    model.eval()
    out = {}
    for split, loader in loaders.items():
        total = torch.zeros(1, device=device)
        for _ in range(eval_iters):
            x, y = loader.next_batch()
            _, loss = model(x, y)
            total += loss
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        out[split] = total.item() / (eval_iters * dist.get_world_size())
    model.train()
    return out


def save_model(model, path):
    # every rank has to enter the state_dict() call (it all-gathers the shards);
    # with rank0_only only rank 0 gets the full tensors back, on the CPU.
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
    if is_main_process():
        torch.save(state, path)
    dist.barrier()


def main():
    args = get_args()
    rank, local_rank, world_size = setup()
    device = torch.device(f"cuda:{local_rank}")

    # same init on every rank; the data stream differs per rank on purpose
    torch.manual_seed(args.seed)
    train_loader = BinLoader(os.path.join(args.data_dir, "train.bin"), args.block_size,
                             args.micro_batch, device, seed=args.seed + rank)
    val_loader = BinLoader(os.path.join(args.data_dir, "val.bin"), args.block_size,
                           args.micro_batch, device, seed=args.seed + 10_000 + rank)

    if is_main_process():
        os.makedirs(args.out_dir, exist_ok=True)
    tokens_per_iter = args.micro_batch * args.block_size * args.grad_accum * world_size
    print0(f"world_size={world_size} tokens/iter={tokens_per_iter:,}")

    model = GPT(args)
    n_params = sum(p.numel() for p in model.parameters())
    print0(f"model params: {n_params / 1e6:.1f}M")

    mp_policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                               buffer_dtype=torch.bfloat16)
    model = FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=mp_policy,
        device_id=torch.cuda.current_device(),
        use_orig_params=True,
        limit_all_gathers=True,
    )

    # after wrapping, the local shards are flat 1-D views, so group by name, not by p.dim()
    def is_no_decay(name):
        return ".ln_" in name or name.startswith("ln_") or name.endswith(".bias")

    decay = [p for n, p in model.named_parameters() if not is_no_decay(n)]
    no_decay = [p for n, p in model.named_parameters() if is_no_decay(n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95))

    best_val = float("inf")
    t0 = time.time()
    for it in range(args.max_iters + 1):
        lr = get_lr(it, args)
        for g in optimizer.param_groups:
            g["lr"] = lr

        if it % args.eval_interval == 0 and it > 0:
            losses = estimate_loss(model, {"train": train_loader, "val": val_loader},
                                   args.eval_iters, device)
            print0(f"iter {it}: train {losses['train']:.4f} val {losses['val']:.4f}")
            if losses["val"] < best_val:
                best_val = losses["val"]
                save_model(model, os.path.join(args.out_dir, "best.pt"))

        for micro in range(args.grad_accum):
            x, y = train_loader.next_batch()
            if micro < args.grad_accum - 1:
                with model.no_sync():
                    _, loss = model(x, y)
                    (loss / args.grad_accum).backward()
            else:
                _, loss = model(x, y)
                (loss / args.grad_accum).backward()

        grad_norm = model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if it % args.log_interval == 0:
            loss_val = loss.detach()
            dist.all_reduce(loss_val, op=dist.ReduceOp.AVG)
            dt = time.time() - t0
            t0 = time.time()
            print0(f"iter {it}: loss {loss_val.item():.4f} lr {lr:.2e} "
                   f"gnorm {grad_norm.item():.2f} {dt * 1000 / args.log_interval:.0f}ms/it")

    save_model(model, os.path.join(args.out_dir, "final.pt"))
    cleanup()


if __name__ == "__main__":
    main()
