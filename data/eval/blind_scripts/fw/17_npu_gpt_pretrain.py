#!/usr/bin/env python
"""nanoGPT-style pretraining of a 124M GPT on a Chinese web corpus, Ascend 910B x 16 (2 nodes).

    source /usr/local/Ascend/ascend-toolkit/set_env.sh
    export HCCL_CONNECT_TIMEOUT=1200
    torchrun --nnodes=2 --node_rank=$NODE_RANK --nproc_per_node=8 \
        --master_addr=10.20.0.11 --master_port=29600 \
        17_npu_gpt_pretrain.py --raw /mnt/sfs/corpus/zh_web.jsonl --out /mnt/sfs/ckpt/gpt124m
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch_npu  # noqa: F401
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoTokenizer


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--raw", required=True, help="jsonl with a 'text' field")
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", default="bert-base-chinese")
    p.add_argument("--n_layer", type=int, default=12)
    p.add_argument("--n_head", type=int, default=12)
    p.add_argument("--n_embd", type=int, default=768)
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--micro_batch", type=int, default=12)
    p.add_argument("--total_batch_tokens", type=int, default=491520)
    p.add_argument("--max_iters", type=int, default=20000)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min_lr", type=float, default=6e-5)
    p.add_argument("--warmup_iters", type=int, default=1000)
    p.add_argument("--eval_every", type=int, default=500)
    p.add_argument("--eval_iters", type=int, default=50)
    return p.parse_args()


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))


def prepare_data(args):
    """Tokenize the raw jsonl once into uint16 train/val .bin files next to the checkpoints."""
    train_bin = os.path.join(args.out, "train.bin")
    val_bin = os.path.join(args.out, "val.bin")
    if dist.get_rank() == 0 and not os.path.exists(train_bin):
        os.makedirs(args.out, exist_ok=True)
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        ids = []
        with open(args.raw, encoding="utf-8") as f:
            for line in f:
                ids.extend(tok.encode(json.loads(line)["text"], add_special_tokens=False))
                ids.append(tok.sep_token_id)
        arr = np.array(ids, dtype=np.uint16)
        n_val = len(arr) // 200
        arr[:-n_val].tofile(train_bin + ".tmp")
        arr[-n_val:].tofile(val_bin)
        os.replace(train_bin + ".tmp", train_bin)
    dist.barrier()
    return train_bin, val_bin


def get_batch(path, block_size, batch, device, gen):
    data = np.memmap(path, dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size - 1, (batch,), generator=gen)
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def lr_at(it, args):
    if it < args.warmup_iters:
        return args.lr * (it + 1) / args.warmup_iters
    ratio = (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * min(ratio, 1.0))) * (args.lr - args.min_lr)


@torch.no_grad()
def estimate_val_loss(model, path, args, device, gen):
    model.eval()
    losses = torch.zeros(args.eval_iters, device=device)
    for k in range(args.eval_iters):
        x, y = get_batch(path, args.block_size, args.micro_batch, device, gen)
        with torch.autocast("npu", dtype=torch.bfloat16):
            losses[k] = model(x, y)
    loss = losses.mean()
    dist.all_reduce(loss)
    loss /= dist.get_world_size()
    model.train()
    return loss.item()


def main():
    args = parse_args()
    train_bin, val_bin = prepare_data(args)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.npu.set_device(local_rank)
    dist.init_process_group(backend="hccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"npu:{local_rank}")
    master = rank == 0

    tokens_per_micro = args.micro_batch * args.block_size * world
    assert args.total_batch_tokens % tokens_per_micro == 0
    accum = args.total_batch_tokens // tokens_per_micro

    torch.manual_seed(1337)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = (len(tok) + 63) // 64 * 64
    model = GPT(vocab, args.block_size, args.n_layer, args.n_head, args.n_embd).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    # different random windows per rank, reproducible across restarts
    gen = torch.Generator().manual_seed(1000 + rank)
    if master:
        print(f"world {world}, grad accum {accum}, vocab {vocab}", flush=True)

    t0 = time.time()
    for it in range(args.max_iters):
        for g in optimizer.param_groups:
            g["lr"] = lr_at(it, args)
        for micro in range(accum):
            x, y = get_batch(train_bin, args.block_size, args.micro_batch, device, gen)
            model.require_backward_grad_sync = micro == accum - 1
            with torch.autocast("npu", dtype=torch.bfloat16):
                loss = model(x, y) / accum
            loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if master and it % 10 == 0:
            dt = time.time() - t0
            t0 = time.time()
            print(f"iter {it} loss {loss.item() * accum:.4f} lr {lr_at(it, args):.2e} {dt * 100:.0f}ms/iter",
                  flush=True)
        if (it + 1) % args.eval_every == 0:
            val = estimate_val_loss(model.module, val_bin, args, device, gen)
            if master:
                print(f"iter {it + 1} val loss {val:.4f}", flush=True)
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "iter": it + 1, "args": vars(args)}, os.path.join(args.out, "ckpt.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
