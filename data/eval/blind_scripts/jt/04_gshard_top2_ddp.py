#!/usr/bin/env python
# GShard-style top-2 MoE language model, data parallel over all GPUs.
#
#   torchrun --nnodes=1 --nproc_per_node=8 04_gshard_top2_ddp.py \
#       --train-shards "/mnt/lm/tok/train_*.npy" --val-shard /mnt/lm/tok/val_000.npy
import argparse
import glob
import json
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("gshard")


def parse_args():
    ap = argparse.ArgumentParser(description="top-2 MoE LM pretraining")
    ap.add_argument("--train-shards", required=True)
    ap.add_argument("--val-shard", required=True)
    ap.add_argument("--output-dir", default="outputs/gshard_top2")
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--vocab-size", type=int, default=50304)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--num-experts", type=int, default=8)
    ap.add_argument("--capacity-factor", type=float, default=1.5)
    ap.add_argument("--aux-loss-weight", type=float, default=0.01)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup-steps", type=int, default=2000)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--log-interval", type=int, default=25)
    return ap.parse_args()


class NpyShard(Dataset):
    """One pre-tokenized shard (int32 .npy), cut into seq_len+1 windows."""

    def __init__(self, path, seq_len):
        self.path = path
        self.seq_len = seq_len
        self.n = (np.load(path, mmap_mode="r").shape[0] - 1) // seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        arr = np.load(self.path, mmap_mode="r")
        w = torch.as_tensor(arr[i * self.seq_len:(i + 1) * self.seq_len + 1].astype(np.int64))
        return w[:-1], w[1:]


class Top2Gate(nn.Module):
    def __init__(self, d_model, num_experts, capacity_factor):
        super().__init__()
        self.wg = nn.Linear(d_model, num_experts, bias=False)
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor

    def forward(self, x):
        logits = self.wg(x).float()
        gates = logits.softmax(dim=-1)
        top2_val, top2_idx = gates.topk(2, dim=-1)
        top2_val = top2_val / top2_val.sum(-1, keepdim=True).clamp_min(1e-9)
        me = gates.mean(0)
        ce = F.one_hot(top2_idx[:, 0], self.num_experts).float().mean(0)
        l_aux = (me * ce).sum() * self.num_experts
        capacity = math.ceil(2 * self.capacity_factor * x.size(0) / self.num_experts)
        return top2_val, top2_idx, l_aux, capacity


class MoEFeedForward(nn.Module):
    def __init__(self, d_model, num_experts, capacity_factor):
        super().__init__()
        self.gate = Top2Gate(d_model, num_experts, capacity_factor)
        self.experts = nn.ModuleList([
            nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
            for _ in range(num_experts)])

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        w, idx, l_aux, capacity = self.gate(flat)
        out = torch.zeros_like(flat)
        n_routed = 0
        for e, expert in enumerate(self.experts):
            tok, which = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            tok, which = tok[:capacity], which[:capacity]
            n_routed += tok.numel()
            y = expert(flat[tok]) * w[tok, which].unsqueeze(-1)
            out.index_add_(0, tok, y.to(out.dtype))
        dropped = 1.0 - n_routed / (2 * flat.size(0))
        return out.view(B, T, C), l_aux, dropped


class Block(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.ln1 = nn.LayerNorm(args.d_model)
        self.ln2 = nn.LayerNorm(args.d_model)
        self.attn = nn.MultiheadAttention(args.d_model, args.n_head, batch_first=True)
        self.moe = MoEFeedForward(args.d_model, args.num_experts, args.capacity_factor)

    def forward(self, x, causal):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        y, l_aux, dropped = self.moe(self.ln2(x))
        return x + y, l_aux, dropped


class MoELM(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.tok_emb = nn.Embedding(args.vocab_size, args.d_model)
        self.pos_emb = nn.Embedding(args.seq_len, args.d_model)
        self.blocks = nn.ModuleList([Block(args) for _ in range(args.n_layer)])
        self.ln_f = nn.LayerNorm(args.d_model)
        self.head = nn.Linear(args.d_model, args.vocab_size, bias=False)
        self.register_buffer("causal", torch.ones(args.seq_len, args.seq_len).triu(1).bool(), persistent=False)

    def forward(self, idx):
        T = idx.size(1)
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))
        aux_total, drop_total = 0.0, 0.0
        for blk in self.blocks:
            x, l_aux, dropped = blk(x, self.causal[:T, :T])
            aux_total = aux_total + l_aux
            drop_total += dropped
        n = len(self.blocks)
        return self.head(self.ln_f(x)), aux_total / n, drop_total / n


def warmup_cosine(optimizer, warmup, total):
    def fn(step):
        if step < warmup:
            return step / max(1, warmup)
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, _, _ = model(x)
        s[0] += F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1), reduction="sum")
        s[1] += y.numel()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(message)s")
    torch.manual_seed(0)

    shards = sorted(glob.glob(args.train_shards))
    train_ds = ConcatDataset([NpyShard(p, args.seq_len) for p in shards])
    val_ds = NpyShard(args.val_shard, args.seq_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=6, pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, num_workers=2)
    logger.info("%d shards, %d train windows, world size %d", len(shards), len(train_ds), world_size)

    model = MoELM(args).to(device)
    # experts that receive no tokens in a step produce no gradient
    model = DDP(model, device_ids=[args.local_rank], find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total_steps = args.epochs * len(train_dl)
    scheduler = warmup_cosine(optimizer, args.warmup_steps, total_steps)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    step = 0
    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, l_aux, dropped = model(x)
                lm_loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
                loss = lm_loss + args.aux_loss_weight * l_aux
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            scheduler.step()
            step += 1

            if step % args.log_interval == 0:
                t = torch.tensor([lm_loss.item(), l_aux.item(), dropped], device=device)
                dist.all_reduce(t)
                t /= world_size
                logger.info("epoch %d step %d/%d lm %.4f aux %.4f dropped %.2f%% lr %.2e %.1fs",
                            epoch, step, total_steps, t[0], t[1], 100 * t[2],
                            scheduler.get_last_lr()[0], time.time() - t0)
                t0 = time.time()

        val_loss = validate(model, val_dl, device)
        logger.info("epoch %d val loss %.4f ppl %.2f", epoch, val_loss, math.exp(val_loss))
        if rank == 0:
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "step": step}
            torch.save(state, os.path.join(args.output_dir, "last.pt"))
            if val_loss < best:
                best = val_loss
                torch.save(state, os.path.join(args.output_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
