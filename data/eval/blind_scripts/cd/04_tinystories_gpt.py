"""
TinyStories GPT pretraining. Tokenizes the dataset into uint16 bins on first run,
then trains on random windows from the memmap.

    torchrun --standalone --nproc_per_node=8 04_tinystories_gpt.py --data_dir /scratch/tinystories
"""
import os
import math
import time
import argparse

import numpy as np
import tiktoken
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from datasets import load_dataset
from tqdm import tqdm


def write_bins(data_dir, num_proc=16):
    enc = tiktoken.get_encoding("gpt2")
    ds = load_dataset("roneneldan/TinyStories")

    def tok(example):
        ids = enc.encode_ordinary(example["text"])
        ids.append(enc.eot_token)
        return {"ids": ids, "len": len(ids)}

    for split, hf_split in [("train", "train"), ("val", "validation")]:
        tokenized = ds[hf_split].map(tok, remove_columns=["text"], num_proc=num_proc,
                                     desc=f"tokenizing {split}")
        total = int(np.sum(tokenized["len"], dtype=np.uint64))
        path = os.path.join(data_dir, f"{split}.bin")
        arr = np.memmap(path, dtype=np.uint16, mode="w+", shape=(total,))
        idx = 0
        n_shards = 256
        for i in tqdm(range(n_shards), desc=f"writing {path}"):
            shard = tokenized.shard(num_shards=n_shards, index=i, contiguous=True).with_format("numpy")
            chunk = np.concatenate(shard["ids"])
            arr[idx:idx + len(chunk)] = chunk
            idx += len(chunk)
        arr.flush()


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = MLP(d)
        self.h = h

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.n1(x)).chunk(3, dim=-1)
        q, k, v = [t.view(B, T, self.h, D // self.h).transpose(1, 2) for t in (q, k, v)]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x = x + self.o(a)
        return x + self.mlp(self.n2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab, ctx, d, h, L):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, ctx, d))
        self.blocks = nn.Sequential(*[Block(d, h) for _ in range(L)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        nn.init.normal_(self.pos, std=0.01)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[:, : idx.size(1)]
        return self.head(self.norm(self.blocks(x)))


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="data/tinystories")
    p.add_argument("--out_dir", default="out/tinystories")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--d_model", type=int, default=512)
    p.add_argument("--n_head", type=int, default=8)
    p.add_argument("--n_layer", type=int, default=8)
    p.add_argument("--micro_bs", type=int, default=64)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--iters", type=int, default=20000)
    p.add_argument("--eval_every", type=int, default=500)
    p.add_argument("--eval_iters", type=int, default=100)
    p.add_argument("--compile", type=int, default=1)
    return p.parse_args()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = f"cuda:{local_rank}"
    master = rank == 0

    os.makedirs(args.data_dir, exist_ok=True)
    if not os.path.exists(os.path.join(args.data_dir, "val.bin")):
        write_bins(args.data_dir)

    train_data = np.memmap(os.path.join(args.data_dir, "train.bin"), dtype=np.uint16, mode="r")
    val_data = np.memmap(os.path.join(args.data_dir, "val.bin"), dtype=np.uint16, mode="r")
    if master:
        print(f"train tokens {len(train_data):,}  val tokens {len(val_data):,}")

    torch.manual_seed(42 + rank)
    np.random.seed(42 + rank)

    def batch(data):
        ix = np.random.randint(0, len(data) - args.ctx - 1, size=args.micro_bs)
        x = np.stack([data[i:i + args.ctx] for i in ix]).astype(np.int64)
        y = np.stack([data[i + 1:i + 1 + args.ctx] for i in ix]).astype(np.int64)
        return (torch.from_numpy(x).pin_memory().to(device, non_blocking=True),
                torch.from_numpy(y).pin_memory().to(device, non_blocking=True))

    torch.manual_seed(42)
    model = TinyGPT(50257, args.ctx, args.d_model, args.n_head, args.n_layer).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if args.compile:
        model = torch.compile(model)
    model = DDP(model, device_ids=[local_rank])

    def lr_at(it):
        if it < args.warmup:
            return args.lr * (it + 1) / args.warmup
        r = (it - args.warmup) / max(1, args.iters - args.warmup)
        return 0.1 * args.lr + 0.45 * args.lr * (1 + math.cos(math.pi * r))

    @torch.no_grad()
    def eval_loss():
        model.eval()
        tot = torch.zeros((), device=device)
        for _ in range(args.eval_iters):
            x, y = batch(val_data)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            tot += F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        tot /= args.eval_iters
        dist.all_reduce(tot, op=dist.ReduceOp.AVG)
        model.train()
        return tot.item()

    tokens_per_iter = args.micro_bs * args.ctx * args.accum * world
    best = float("inf")
    t0 = time.time()
    for it in range(args.iters + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(it)

        if it % args.eval_every == 0:
            vl = eval_loss()
            if master:
                print(f"it {it} val {vl:.4f}")
                if vl < best and it > 0:
                    best = vl
                    os.makedirs(args.out_dir, exist_ok=True)
                    torch.save({"model": model.module.state_dict() if not args.compile
                                else model.module._orig_mod.state_dict(),
                                "it": it, "val": vl, "args": vars(args)},
                               os.path.join(args.out_dir, "best.pt"))
        if it == args.iters:
            break

        for m in range(args.accum):
            x, y = batch(train_data)
            with model.no_sync() if m < args.accum - 1 else torch.enable_grad():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(x)
                    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / args.accum
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

        if master and it % 50 == 0:
            torch.cuda.synchronize()
            dt = (time.time() - t0) / (50 if it else 1)
            t0 = time.time()
            print(f"it {it} loss {loss.item() * args.accum:.4f} {dt*1000:.0f}ms/it "
                  f"{tokens_per_iter / dt:,.0f} tok/s")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
