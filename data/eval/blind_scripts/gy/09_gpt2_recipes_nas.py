#!/usr/bin/env python3
"""
Fine-tune GPT-2 (124M) on my scraped recipe corpus.

Machines: 'tower' (RTX 3090, 192.168.1.5) and 'htpc' (RTX 3060, 192.168.1.8).
The corpus lives on the Synology, NFS-mounted at /mnt/syno on both machines,
so there is one copy of the text and of the token cache.

  tower$ torchrun --nnodes=2 --nproc_per_node=1 --node_rank=0 --master_addr=192.168.1.5 \
             --master_port=29600 gpt2_recipes.py
  htpc$  torchrun --nnodes=2 --nproc_per_node=1 --node_rank=1 --master_addr=192.168.1.5 \
             --master_port=29600 gpt2_recipes.py
"""
import argparse
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import GPT2LMHeadModel, GPT2TokenizerFast


class BlockDataset(Dataset):
    """Fixed-length blocks cut out of one long token stream."""

    def __init__(self, tokens, block_size):
        self.tokens = tokens
        self.block_size = block_size
        self.n_blocks = len(tokens) // block_size

    def __len__(self):
        return self.n_blocks

    def __getitem__(self, i):
        s = i * self.block_size
        # GPT2LMHeadModel shifts the labels itself
        return torch.from_numpy(self.tokens[s: s + self.block_size].astype(np.int64))


def tokenize_corpus(corpus_dir, tokenizer):
    ids = []
    files = sorted(glob.glob(os.path.join(corpus_dir, "*.txt")))
    for fn in files:
        with open(fn, encoding="utf-8", errors="ignore") as f:
            text = f.read()
        for recipe in text.split("\n\n\n"):
            recipe = recipe.strip()
            if len(recipe) < 50:
                continue
            ids.extend(tokenizer.encode(recipe))
            ids.append(tokenizer.eos_token_id)
    return np.array(ids, dtype=np.uint16)


def load_tokens(args, tokenizer, local_rank):
    cache = os.path.join(args.corpus, "cache", f"gpt2_tokens_v{args.cache_version}.npy")
    if local_rank == 0 and not os.path.exists(cache):
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        print(f"tokenizing {args.corpus} -> {cache}", flush=True)
        arr = tokenize_corpus(args.corpus, tokenizer)
        np.save(cache, arr)
    dist.barrier()
    return np.load(cache, mmap_mode="r")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", default="/mnt/syno/datasets/recipes")
    p.add_argument("--cache-version", type=int, default=3)
    p.add_argument("--out", default=os.path.expanduser("~/runs/gpt2-recipes"))
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--val-frac", type=float, default=0.02)
    return p.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tokenizer = GPT2TokenizerFast.from_pretrained("gpt2")
    tokens = load_tokens(args, tokenizer, local_rank)
    n_val = int(len(tokens) * args.val_frac)
    train_ds = BlockDataset(tokens[:-n_val], args.block_size)
    val_ds = BlockDataset(tokens[-n_val:], args.block_size)
    if rank == 0:
        print(f"{len(tokens) / 1e6:.1f}M tokens, {len(train_ds)} train blocks, {len(val_ds)} val blocks")

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=2, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, num_workers=2)

    model = GPT2LMHeadModel.from_pretrained("gpt2").to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    updates_per_epoch = len(train_dl) // args.grad_accum
    total_updates = updates_per_epoch * args.epochs
    warmup = max(1, total_updates // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda u: min(1.0, (u + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(u, total_updates) / total_updates)))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(1, device=device)
        opt.zero_grad(set_to_none=True)
        for i, x in enumerate(train_dl):
            x = x.to(device, non_blocking=True)
            last_micro = (i + 1) % args.grad_accum == 0
            ctx = model.no_sync() if not last_micro else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=x, labels=x).loss
                (loss / args.grad_accum).backward()
            running += loss.detach()
            if last_micro:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                u = (i + 1) // args.grad_accum
                if u % 50 == 0:
                    dist.all_reduce(running, op=dist.ReduceOp.AVG)
                    if rank == 0:
                        print(f"ep {epoch} upd {u}/{updates_per_epoch} "
                              f"loss {running.item() / (50 * args.grad_accum):.4f} "
                              f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)
                    running.zero_()

        model.eval()
        vl = torch.zeros(2, device=device)
        with torch.no_grad():
            for x in val_dl:
                x = x.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    vl[0] += model.module(input_ids=x, labels=x).loss
                vl[1] += 1
        dist.all_reduce(vl)
        if rank == 0:
            val_loss = (vl[0] / vl[1]).item()
            print(f"epoch {epoch} val loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}")
            model.module.save_pretrained(os.path.join(args.out, f"epoch{epoch}"))
            tokenizer.save_pretrained(os.path.join(args.out, f"epoch{epoch}"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
