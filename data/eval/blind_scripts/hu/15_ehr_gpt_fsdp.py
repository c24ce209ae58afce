"""Autoregressive foundation model over patient timelines (codes + time tokens), trained with FSDP.

Timeline tokens: [BOS] [AGE_45] [GENDER_F] dx/... med/... lab/..._Q3 [T_1w] dx/... [VISIT_END] ...
Pre-tokenized shards are memory-mapped uint32 arrays with an offsets index.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
        15_ehr_gpt_fsdp.py --data /shared/timelines/v4 --out /shared/ckpt/ehrgpt-350m
"""
import argparse
import functools
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--d_model", type=int, default=1024)
    p.add_argument("--n_layers", type=int, default=24)
    p.add_argument("--n_heads", type=int, default=16)
    p.add_argument("--micro_bs", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--min_lr", type=float, default=3e-5)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--max_steps", type=int, default=100_000)
    p.add_argument("--eval_every", type=int, default=2000)
    p.add_argument("--save_every", type=int, default=5000)
    return p.parse_args()


class TimelineShards(Dataset):
    """Fixed-length windows cut from each patient timeline (last window is right-aligned)."""

    def __init__(self, root, split, ctx):
        self.tokens = np.load(os.path.join(root, f"{split}_tokens.npy"), mmap_mode="r")
        offsets = np.load(os.path.join(root, f"{split}_offsets.npy"))
        self.ctx = ctx
        windows = []
        for start, end in zip(offsets[:-1], offsets[1:]):
            n = end - start
            if n < 16:
                continue
            for s in range(start, end - 1, ctx):
                windows.append(min(s, max(start, end - ctx - 1)))
        self.windows = np.asarray(windows, dtype=np.int64)

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        s = self.windows[i]
        chunk = np.asarray(self.tokens[s:s + self.ctx + 1], dtype=np.int64)
        x = np.zeros(self.ctx + 1, dtype=np.int64)
        x[: len(chunk)] = chunk
        return torch.from_numpy(x[:-1]), torch.from_numpy(x[1:])


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.GELU(), nn.Linear(4 * d, d, bias=False))
        self.h = h

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.ln2(x))


class EHRGPT(nn.Module):
    def __init__(self, vocab, ctx, d, n_layers, h):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=0)


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    r = (step - args.warmup) / max(1, args.max_steps - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(r, 1.0)))


@torch.no_grad()
def evaluate(model, loader, device, max_batches=200):
    model.eval()
    acc = torch.zeros(2, device=device)
    for i, (x, y) in enumerate(loader):
        if i >= max_batches:
            break
        acc += torch.stack([model(x.to(device), y.to(device)), torch.ones((), device=device)])
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def save_full(model, path, step):
    if dist.get_rank() == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        torch.save({"model": state, "step": step}, path)


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    with open(os.path.join(args.data, "vocab.json")) as f:
        vocab_size = len(json.load(f))
    train_ds = TimelineShards(args.data, "train", args.ctx)
    val_ds = TimelineShards(args.data, "val", args.ctx)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.micro_bs, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=args.micro_bs,
                            sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True), num_workers=2)

    model = EHRGPT(vocab_size, args.ctx, args.d_model, args.n_layers, args.n_heads)
    if rank == 0:
        print(f"params {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M, windows {len(train_ds)}", flush=True)
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=local_rank,
        use_orig_params=True,
    )
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=True)

    os.makedirs(args.out, exist_ok=True)
    step, epoch = 0, 0
    t0 = time.time()
    model.train()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args)
            loss = model(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            step += 1

            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    tps = 50 * args.micro_bs * args.ctx * world / (time.time() - t0)
                    print(f"step {step} loss {l.item():.4f} lr {lr_at(step, args):.2e} tok/s {tps:,.0f}", flush=True)
                t0 = time.time()
            if step % args.eval_every == 0:
                vl = evaluate(model, val_loader, device)
                if rank == 0:
                    print(f"step {step} val_loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
            if step % args.save_every == 0:
                save_full(model, os.path.join(args.out, f"step{step:07d}.pt"), step)
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    save_full(model, os.path.join(args.out, "final.pt"), step)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
