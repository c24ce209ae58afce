#!/usr/bin/env python
"""Pretrain a GPT-style decoder with FSDP, fp16 autocast and gradient accumulation.

Data is a flat uint16 token file produced by prepare_tokens.py (nanoGPT style).
"""
import argparse
import contextlib
import functools
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import (
    FullStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train_bin", default="data/owt/train.bin")
    p.add_argument("--val_bin", default="data/owt/val.bin")
    p.add_argument("--out_dir", default="runs/gpt_fsdp")
    p.add_argument("--n_layer", type=int, default=24)
    p.add_argument("--n_head", type=int, default=16)
    p.add_argument("--n_embd", type=int, default=1024)
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--vocab_size", type=int, default=50304)
    p.add_argument("--batch_size", type=int, default=8, help="micro batch per GPU")
    p.add_argument("--grad_accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--min_lr", type=float, default=3e-5)
    p.add_argument("--warmup_steps", type=int, default=2000)
    p.add_argument("--max_steps", type=int, default=100000)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--eval_every", type=int, default=1000)
    p.add_argument("--eval_batches", type=int, default=50)
    p.add_argument("--log_every", type=int, default=20)
    return p.parse_args()


class TokenChunks(Dataset):
    def __init__(self, path, block_size):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.block_size = block_size

    def __len__(self):
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, idx):
        i = idx * self.block_size
        chunk = torch.from_numpy(self.data[i : i + self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd, bias=False),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd, bias=False),
        )

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.wte = nn.Embedding(args.vocab_size, args.n_embd)
        self.wpe = nn.Embedding(args.block_size, args.n_embd)
        self.blocks = nn.ModuleList([Block(args.n_embd, args.n_head) for _ in range(args.n_layer)])
        self.ln_f = nn.LayerNorm(args.n_embd)
        self.lm_head = nn.Linear(args.n_embd, args.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.ln_f(x))


def lr_at(step, args):
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    ratio = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


@torch.no_grad()
def evaluate(model, loader, args, device):
    model.eval()
    tot = torch.zeros(2, device=device)
    for i, (x, y) in enumerate(loader):
        if i >= args.eval_batches:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1), reduction="sum")
        tot[0] += loss
        tot[1] += y.numel()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def save_checkpoint(model, step, args, rank):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        torch.save({"model": state, "step": step, "args": vars(args)},
                   os.path.join(args.out_dir, f"ckpt_{step:07d}.pt"))
    dist.barrier()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1337)

    train_ds = TokenChunks(args.train_bin, args.block_size)
    val_ds = TokenChunks(args.val_bin, args.block_size)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1337, drop_last=True)
    # every rank must run the same number of forwards under FSDP
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=2, pin_memory=True, drop_last=True)

    model = GPT(args)
    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=device,
        limit_all_gathers=True,
    )
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters()) * world_size
        print(f"~{n_params / 1e6:.1f}M parameters (sharded over {world_size} ranks)")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=args.weight_decay, fused=True)
    scaler = ShardedGradScaler()

    step, micro, epoch = 0, 0, 0
    t0 = time.time()
    model.train()
    while step < args.max_steps:
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            micro += 1
            last_micro = micro % args.grad_accum == 0
            ctx = contextlib.nullcontext() if last_micro else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.float16):
                    logits = model(x)
                    loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
                scaler.scale(loss / args.grad_accum).backward()
            if not last_micro:
                continue

            for g in optimizer.param_groups:
                g["lr"] = lr_at(step, args)
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % args.log_every == 0:
                loss_t = loss.detach()
                dist.all_reduce(loss_t, op=dist.ReduceOp.AVG)
                if rank == 0:
                    dt = (time.time() - t0) / args.log_every
                    print(f"step {step} loss {loss_t.item():.4f} gnorm {grad_norm.item():.3f} "
                          f"scale {scaler.get_scale():.0f} lr {lr_at(step, args):.2e} {dt * 1000:.0f}ms/it",
                          flush=True)
                t0 = time.time()

            if step % args.eval_every == 0:
                val_loss = evaluate(model, val_loader, args, device)
                if rank == 0:
                    print(f"step {step} val_loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}", flush=True)
                save_checkpoint(model, step, args, rank)

            if step >= args.max_steps:
                break
        epoch += 1

    save_checkpoint(model, step, args, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
