# Pretrain a small LLaMA-style model on pre-tokenized uint16 shards with FSDP.
# Loosely follows litgpt/pretrain.py, without Fabric.
#
#   torchrun --nnodes=1 --nproc_per_node=8 pretrain_llama_fsdp.py --out_dir out/llama-350m
import argparse
import functools
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
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy


@dataclass
class Config:
    block_size: int = 2048
    vocab_size: int = 32000
    padded_vocab_size: int = 32000
    n_layer: int = 24
    n_head: int = 16
    n_query_groups: int = 4
    n_embd: int = 1024
    intermediate_size: int = 2816
    rope_base: int = 10000
    norm_eps: float = 1e-5

    @property
    def head_size(self):
        return self.n_embd // self.n_head


def build_rope_cache(seq_len, n_elem, base, device=None):
    theta = 1.0 / (base ** (torch.arange(0, n_elem, 2, device=device).float() / n_elem))
    seq_idx = torch.arange(seq_len, device=device).float()
    idx_theta = torch.outer(seq_idx, theta).repeat(1, 2)
    return torch.cos(idx_theta), torch.sin(idx_theta)


def apply_rope(x, cos, sin):
    head_size = x.size(-1)
    x1 = x[..., : head_size // 2]
    x2 = x[..., head_size // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    roped = (x * cos) + (rotated * sin)
    return roped.to(dtype=x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x.to(dtype)) * self.weight


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        hs = config.head_size
        shape = (config.n_head + 2 * config.n_query_groups) * hs
        self.attn = nn.Linear(config.n_embd, shape, bias=False)
        self.proj = nn.Linear(config.n_head * hs, config.n_embd, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.size()
        cfg = self.config
        hs = cfg.head_size
        q_per_kv = cfg.n_head // cfg.n_query_groups
        qkv = self.attn(x).view(B, T, cfg.n_query_groups, q_per_kv + 2, hs).permute(0, 2, 3, 1, 4)
        q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
        k = k.expand(B, cfg.n_query_groups, q_per_kv, T, hs)
        v = v.expand(B, cfg.n_query_groups, q_per_kv, T, hs)
        q = q.reshape(B, -1, T, hs)
        k = k.reshape(B, -1, T, hs)
        v = v.reshape(B, -1, T, hs)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, cfg.n_head * hs)
        return self.proj(y)


class LLaMAMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc_1 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.fc_2 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x):
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm_1 = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.norm_2 = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = LLaMAMLP(config)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm_1(x), cos, sin)
        return x + self.mlp(self.norm_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = RMSNorm(config.n_embd, config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        cos, sin = build_rope_cache(config.block_size, config.head_size, config.rope_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def reset_parameters(self):
        std = math.sqrt(2.0 / 5 / self.config.n_embd)
        for name, p in self.named_parameters():
            if p.ndim == 1:
                nn.init.ones_(p)
            elif p.ndim == 2:
                nn.init.normal_(p, mean=0.0, std=std)
                if name.endswith("proj.weight"):
                    nn.init.normal_(p, mean=0.0, std=1 / math.sqrt(self.config.n_embd) / self.config.n_layer)

    def forward(self, idx):
        T = idx.size(1)
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.wte(idx)
        for block in self.h:
            x = block(x, cos, sin)
        return self.lm_head(self.ln_f(x))


class ShardedTokenDataset:
    """Random windows from memmapped uint16 shards; each rank has its own RNG stream."""

    def __init__(self, pattern, block_size, batch_size, seed, rank):
        self.files = sorted(glob.glob(pattern))
        assert self.files, pattern
        self.data = [np.memmap(f, dtype=np.uint16, mode="r") for f in self.files]
        self.sizes = np.array([len(d) for d in self.data], dtype=np.float64)
        self.block_size = block_size
        self.batch_size = batch_size
        self.rng = np.random.default_rng(seed + rank)

    def next_batch(self, device):
        shard_ids = self.rng.choice(len(self.data), size=self.batch_size, p=self.sizes / self.sizes.sum())
        xs, ys = [], []
        for s in shard_ids:
            d = self.data[s]
            i = int(self.rng.integers(0, len(d) - self.block_size - 1))
            chunk = torch.from_numpy(d[i: i + self.block_size + 1].astype(np.int64))
            xs.append(chunk[:-1])
            ys.append(chunk[1:])
        x = torch.stack(xs).pin_memory().to(device, non_blocking=True)
        y = torch.stack(ys).pin_memory().to(device, non_blocking=True)
        return x, y


@torch.no_grad()
def validate(model, val_tokens, block_size, batch_size, max_tokens, rank, world_size, device):
    model.eval()
    n_windows = min(len(val_tokens) - 1, max_tokens) // block_size
    n_windows -= n_windows % (world_size * batch_size)
    losses = torch.zeros(2, device=device)
    for start in range(rank * batch_size, n_windows, world_size * batch_size):
        idx = np.arange(start, start + batch_size) * block_size
        chunk = np.stack([val_tokens[i: i + block_size + 1] for i in idx]).astype(np.int64)
        chunk = torch.from_numpy(chunk).to(device)
        logits = model(chunk[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
        losses[0] += loss
        losses[1] += chunk[:, 1:].numel()
    dist.all_reduce(losses)
    model.train()
    return (losses[0] / losses[1]).item()


def save_checkpoint(model, step, path, rank):
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        torch.save({"model": state, "step": step}, path)
        print(f"saved checkpoint to {path}")
    dist.barrier()


def get_lr(it, args):
    if it < args.warmup_iters:
        return args.lr * (it + 1) / args.warmup_iters
    if it > args.max_iters:
        return args.min_lr
    ratio = (it - args.warmup_iters) / (args.max_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train_pattern", default="data/slimpajama/train_*.bin")
    p.add_argument("--val_file", default="data/slimpajama/val_000.bin")
    p.add_argument("--out_dir", default="out/llama-350m")
    p.add_argument("--micro_batch_size", type=int, default=8)
    p.add_argument("--global_batch_size", type=int, default=256)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--min_lr", type=float, default=4e-5)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--warmup_iters", type=int, default=2000)
    p.add_argument("--max_iters", type=int, default=60000)
    p.add_argument("--eval_interval", type=int, default=1000)
    p.add_argument("--eval_tokens", type=int, default=4_194_304)
    p.add_argument("--save_interval", type=int, default=5000)
    p.add_argument("--log_interval", type=int, default=10)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    is_master = rank == 0
    torch.manual_seed(args.seed)
    if is_master:
        os.makedirs(args.out_dir, exist_ok=True)

    assert args.global_batch_size % (args.micro_batch_size * world_size) == 0
    grad_accum = args.global_batch_size // (args.micro_batch_size * world_size)

    config = Config()
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.reset_parameters()
    cos, sin = build_rope_cache(config.block_size, config.head_size, config.rope_base, device=device)
    model.cos.copy_(cos)
    model.sin.copy_(sin)

    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32),
        device_id=local_rank,
        sync_module_states=True,
        limit_all_gathers=True,
        use_orig_params=True,
    )
    if args.compile:
        model = torch.compile(model)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=True,
    )

    train_data = ShardedTokenDataset(args.train_pattern, config.block_size, args.micro_batch_size, args.seed, rank)
    val_tokens = np.memmap(args.val_file, dtype=np.uint16, mode="r")

    t0 = time.perf_counter()
    for it in range(args.max_iters + 1):
        lr = get_lr(it, args)
        for g in optimizer.param_groups:
            g["lr"] = lr

        if it % args.eval_interval == 0 or it == args.max_iters:
            val_loss = validate(model, val_tokens, config.block_size, args.micro_batch_size,
                                args.eval_tokens, rank, world_size, device)
            if is_master:
                print(f"iter {it}: val loss {val_loss:.4f}, val ppl {math.exp(val_loss):.2f}")

        if it > 0 and (it % args.save_interval == 0 or it == args.max_iters):
            save_checkpoint(model, it, os.path.join(args.out_dir, f"iter-{it:06d}-ckpt.pth"), rank)

        if it == args.max_iters:
            break

        loss_sum = torch.zeros((), device=device)
        for micro in range(grad_accum):
            x, y = train_data.next_batch(device)
            logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            (loss / grad_accum).backward()
            loss_sum += loss.detach()
        grad_norm = model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if it % args.log_interval == 0:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
            t1 = time.perf_counter()
            if is_master:
                dt = (t1 - t0) / args.log_interval
                print(f"iter {it} | loss {loss_sum.item() / grad_accum:.4f} | lr {lr:.2e} | "
                      f"grad norm {grad_norm.item():.3f} | {dt * 1000:.0f} ms/iter")
            t0 = t1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
