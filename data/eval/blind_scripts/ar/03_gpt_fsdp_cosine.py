"""
GPT pretraining with PyTorch FSDP (1.3B config) on tokenized .bin shards.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        03_gpt_fsdp_cosine.py --data /lustre/datasets/pile_gpt2 --out /lustre/ckpt/gpt1b3
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
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--d_model", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--micro_bsz", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--max_steps", type=int, default=150000)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--min_lr", type=float, default=2e-5)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--save_interval", type=int, default=2000)
    p.add_argument("--log_interval", type=int, default=20)
    return p.parse_args()


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, seq_len, d, h, n_layers):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList([Block(d, h) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class TokenShards:
    """Deterministic strided sampling over the concatenated shards; the cursor is checkpointed."""

    def __init__(self, root, seq_len, rank, world, seed=0):
        files = sorted(f for f in os.listdir(root) if f.endswith(".bin"))
        self.arrs = [np.memmap(os.path.join(root, f), dtype=np.uint16, mode="r") for f in files]
        self.sizes = np.array([len(a) // (seq_len + 1) for a in self.arrs])
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)])
        self.seq_len = seq_len
        self.rank, self.world = rank, world
        self.perm = np.random.default_rng(seed).permutation(int(self.offsets[-1]))
        self.cursor = 0

    def next_batch(self, bsz):
        rows = []
        for _ in range(bsz):
            g = self.perm[(self.cursor * self.world + self.rank) % len(self.perm)]
            self.cursor += 1
            f = int(np.searchsorted(self.offsets, g, side="right") - 1)
            i = int(g - self.offsets[f]) * (self.seq_len + 1)
            rows.append(torch.from_numpy(self.arrs[f][i:i + self.seq_len + 1].astype(np.int64)))
        t = torch.stack(rows)
        return t[:, :-1], t[:, 1:]


def lr_at(step, a):
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    prog = min(1.0, (step - a.warmup) / max(1, a.max_steps - a.warmup))
    return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + math.cos(math.pi * prog))


def save_checkpoint(model, optimizer, step, data_cursor, path):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        model_state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, optimizer)
    torch.save({"model": model_state, "optim": optim_state, "step": step,
                "data_cursor": data_cursor}, path)


def main():
    a = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    torch.manual_seed(1234)

    model = GPT(a.vocab, a.seq_len, a.d_model, a.heads, a.layers)
    n_params = sum(p.numel() for p in model.parameters())
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                          buffer_dtype=torch.bfloat16)
    model = FSDP(model, auto_wrap_policy=wrap, mixed_precision=bf16,
                 sharding_strategy=ShardingStrategy.FULL_SHARD,
                 device_id=torch.cuda.current_device(), use_orig_params=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    other = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd},
                             {"params": other, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)

    data = TokenShards(a.data, a.seq_len, rank, world)
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        print(f"params {n_params / 1e6:.1f}M, world {world}, "
              f"tokens/step {a.micro_bsz * a.grad_accum * world * a.seq_len:,}")

    flops_per_step = 6 * n_params * a.micro_bsz * a.grad_accum * a.seq_len * world
    step = 0
    t0 = time.time()
    model.train()
    while step < a.max_steps:
        lr = lr_at(step, a)
        for g in opt.param_groups:
            g["lr"] = lr
        loss_acc = torch.zeros((), device="cuda")
        for micro in range(a.grad_accum):
            x, y = data.next_batch(a.micro_bsz)
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            if micro < a.grad_accum - 1:
                with model.no_sync():
                    loss = model(x, y) / a.grad_accum
                    loss.backward()
            else:
                loss = model(x, y) / a.grad_accum
                loss.backward()
            loss_acc += loss.detach()
        gnorm = model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        if step % a.log_interval == 0:
            dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)
            torch.cuda.synchronize()
            dt = (time.time() - t0) / a.log_interval
            t0 = time.time()
            if rank == 0:
                mfu = flops_per_step / dt / (989e12 * world)
                print(f"step {step} loss {loss_acc.item():.4f} gnorm {gnorm:.2f} lr {lr:.2e} "
                      f"{dt:.2f}s/step mfu {mfu * 100:.1f}%")

        if step % a.save_interval == 0:
            if rank == 0:
                save_checkpoint(model, opt, step, data.cursor,
                                os.path.join(a.out, f"step{step:07d}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
