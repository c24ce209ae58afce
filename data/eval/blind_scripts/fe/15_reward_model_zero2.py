#!/usr/bin/env python
"""Pairwise reward-model training (Bradley-Terry) on preference data.

ZeRO-2 + DeepSpeed activation checkpointing over the decoder blocks.

    deepspeed --num_gpus 8 15_reward_model_zero2.py --deepspeed --deepspeed_config configs/rm_zero2.json \
        --pairs /shared/data/prefs/pairs.jsonl --base /shared/models/sft3b/model.pt \
        --out /shared/exp/rm3b
"""
import argparse
import json
import os
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import deepspeed
import deepspeed.comm as dist
from torch.utils.data import DataLoader, Dataset, random_split
from torch.utils.data.distributed import DistributedSampler


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", required=True)
    p.add_argument("--base", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50432)
    p.add_argument("--dim", type=int, default=2560)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--val-size", type=int, default=4000)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--eval-steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--local_rank", type=int, default=-1)
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class PreferencePairs(Dataset):
    def __init__(self, path, max_len):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def _pad(self, ids):
        ids = ids[-self.max_len:]
        n = len(ids)
        return torch.tensor(ids + [0] * (self.max_len - n)), n

    def __getitem__(self, i):
        r = self.rows[i]
        chosen, lc = self._pad(r["prompt_ids"] + r["chosen_ids"])
        rejected, lr = self._pad(r["prompt_ids"] + r["rejected_ids"])
        return chosen, torch.tensor(lc), rejected, torch.tensor(lr)


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        T = x.size(1)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class RewardModel(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed = nn.Embedding(a.vocab, a.dim)
        self.pos = nn.Embedding(a.max_len, a.dim)
        self.blocks = nn.ModuleList([Block(a.dim, a.heads) for _ in range(a.layers)])
        self.ln_f = nn.LayerNorm(a.dim)
        self.value_head = nn.Linear(a.dim, 1)

    def forward(self, ids, lengths):
        x = self.embed(ids) + self.pos(torch.arange(ids.size(1), device=ids.device))
        for blk in self.blocks:
            x = deepspeed.checkpointing.checkpoint(blk, x)
        x = self.ln_f(x)
        last = x[torch.arange(x.size(0), device=x.device), lengths - 1]
        return self.value_head(last).squeeze(-1)


def pair_loss(engine, batch):
    chosen, lc, rejected, lr = (t.to(engine.device, non_blocking=True) for t in batch)
    ids = torch.cat([chosen, rejected])
    lens = torch.cat([lc, lr])
    r = engine(ids, lens).float()
    r_c, r_r = r.chunk(2)
    loss = -F.logsigmoid(r_c - r_r).mean()
    acc = (r_c > r_r).float().mean()
    return loss, acc


def main():
    args = parse()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    # different dropout masks per rank
    set_seed(args.seed + rank)

    deepspeed.checkpointing.configure(None, deepspeed_config=args.deepspeed_config)

    full = PreferencePairs(args.pairs, args.max_len)
    train_ds, val_ds = random_split(full, [len(full) - args.val_size, args.val_size])

    model = RewardModel(args)
    sd = torch.load(args.base, map_location="cpu")
    missing, _ = model.load_state_dict(sd, strict=False)
    if rank == 0:
        print(f"loaded base, newly initialised: {missing}")

    engine, _, _, _ = deepspeed.initialize(args=args, model=model,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    mbs = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=mbs, sampler=train_sampler, drop_last=True, num_workers=2)
    val_loader = DataLoader(val_ds, batch_size=mbs, num_workers=2,
                            sampler=DistributedSampler(val_ds, num_replicas=world, rank=rank,
                                                       shuffle=False, drop_last=True))

    def evaluate():
        engine.eval()
        agg = torch.zeros(3, device=engine.device)
        with torch.no_grad():
            for batch in val_loader:
                loss, acc = pair_loss(engine, batch)
                agg += torch.stack([loss, acc, torch.ones((), device=engine.device)])
        dist.all_reduce(agg)
        engine.train()
        return (agg[0] / agg[2]).item(), (agg[1] / agg[2]).item()

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for i, batch in enumerate(train_loader):
            loss, acc = pair_loss(engine, batch)
            engine.backward(loss)
            engine.step()
            if (i + 1) % gas:
                continue
            step = engine.global_steps
            if step % 10 == 0:
                m = torch.stack([loss.detach(), acc])
                dist.all_reduce(m)
                m /= world
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {m[0]:.4f} acc {m[1]:.3f}", flush=True)
            if step % args.eval_steps == 0:
                vl, va = evaluate()
                if rank == 0:
                    print(f"step {step} val loss {vl:.4f} val acc {va:.3f}", flush=True)
                engine.save_checkpoint(args.out, tag=f"step{step}")

    vl, va = evaluate()
    if rank == 0:
        print(f"final val loss {vl:.4f} val acc {va:.3f}")
    engine.save_checkpoint(args.out, tag="final")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
