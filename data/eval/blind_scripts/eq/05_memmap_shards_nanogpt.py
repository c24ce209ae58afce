# Train a small GPT on pre-tokenized uint16 token shards (output of tokenize_shards.py).
#
#   torchrun --standalone --nproc_per_node=4 05_memmap_shards_nanogpt.py \
#       --data_dir /data/openwebtext_tok --out_dir out/owt_124m
#
# Each shard file is a flat np.uint16 array of token ids (shard_00000.bin ...).
# Samples are non-overlapping windows of block_size+1 tokens, indexed across all shards.
import argparse
import bisect
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class TokenShardWindows(Dataset):
    def __init__(self, files, block_size):
        self.files = sorted(files)
        self.block_size = block_size
        self.counts = []
        for f in self.files:
            n_tok = os.path.getsize(f) // 2
            self.counts.append(n_tok // (block_size + 1))
        self.cum = np.cumsum([0] + self.counts).tolist()
        self._mm = {}

    def __len__(self):
        return self.cum[-1]

    def _shard(self, i):
        # opened lazily so every DataLoader worker has its own memmap
        if i not in self._mm:
            self._mm[i] = np.memmap(self.files[i], dtype=np.uint16, mode="r")
        return self._mm[i]

    def __getitem__(self, idx):
        s = bisect.bisect_right(self.cum, idx) - 1
        local = idx - self.cum[s]
        start = local * (self.block_size + 1)
        chunk = np.asarray(self._shard(s)[start:start + self.block_size + 1], dtype=np.int64)
        x = torch.from_numpy(chunk)
        return x[:-1], x[1:]


class Block(nn.Module):
    def __init__(self, d, n_head, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, n_head, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, block_size, d=768, n_layer=12, n_head=12, dropout=0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList([Block(d, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        mask = torch.triu(torch.ones(block_size, block_size, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        T = idx.size(1)
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for blk in self.blocks:
            x = blk(x, self.mask[:T, :T])
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def cycle(loader):
    while True:
        for batch in loader:
            yield batch


def get_lr(it, a):
    if it < a.warmup_iters:
        return a.lr * (it + 1) / a.warmup_iters
    r = min(1.0, (it - a.warmup_iters) / (a.max_iters - a.warmup_iters))
    return a.min_lr + 0.5 * (1.0 + math.cos(math.pi * r)) * (a.lr - a.min_lr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--out_dir", default="out")
    ap.add_argument("--block_size", type=int, default=1024)
    ap.add_argument("--vocab_size", type=int, default=50304)
    ap.add_argument("--batch_size", type=int, default=12)
    ap.add_argument("--total_batch_tokens", type=int, default=491520)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--min_lr", type=float, default=6e-5)
    ap.add_argument("--warmup_iters", type=int, default=2000)
    ap.add_argument("--max_iters", type=int, default=60000)
    ap.add_argument("--eval_interval", type=int, default=1000)
    ap.add_argument("--eval_iters", type=int, default=100)
    ap.add_argument("--num_workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--init_from", choices=["scratch", "resume"], default="scratch")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{local_rank}"
    master = rank == 0
    torch.manual_seed(args.seed)

    tokens_per_micro = args.batch_size * args.block_size * world
    assert args.total_batch_tokens % tokens_per_micro == 0
    accum = args.total_batch_tokens // tokens_per_micro

    train_ds = TokenShardWindows(glob.glob(os.path.join(args.data_dir, "train", "*.bin")), args.block_size)
    val_ds = TokenShardWindows(glob.glob(os.path.join(args.data_dir, "val", "*.bin")), args.block_size)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True,
                                       seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=True,
                                     seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=2, pin_memory=True, drop_last=True)

    model = GPT(args.vocab_size, args.block_size).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    it0 = 0
    ckpt_file = os.path.join(args.out_dir, "ckpt.pt")
    if args.init_from == "resume":
        ck = torch.load(ckpt_file, map_location=device)
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        it0 = ck["iter"]
    model = DDP(model, device_ids=[local_rank])

    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"{len(train_ds):,} train windows, accum {accum}, {accum * tokens_per_micro:,} tok/iter")

    train_batches = cycle(train_loader)
    val_batches = cycle(val_loader)

    @torch.no_grad()
    def estimate_val_loss():
        model.eval()
        losses = torch.zeros(args.eval_iters, device=device)
        for k in range(args.eval_iters):
            x, y = next(val_batches)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                losses[k] = model.module(x.to(device), y.to(device))
        model.train()
        m = losses.mean()
        dist.all_reduce(m, op=dist.ReduceOp.AVG)
        return m.item()

    t0 = time.time()
    for it in range(it0, args.max_iters):
        lr = get_lr(it, args)
        for g in optimizer.param_groups:
            g["lr"] = lr

        if it % args.eval_interval == 0 and it > it0:
            vl = estimate_val_loss()
            if master:
                print(f"iter {it}: val loss {vl:.4f}")
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "iter": it, "args": vars(args)}, ckpt_file)
            dist.barrier()

        for micro in range(accum):
            x, y = next(train_batches)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            model.require_backward_grad_sync = micro == accum - 1
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if it % 10 == 0:
            lossf = loss.detach() * accum
            dist.all_reduce(lossf, op=dist.ReduceOp.AVG)
            if master:
                dt = time.time() - t0
                t0 = time.time()
                print(f"iter {it}: loss {lossf.item():.4f} lr {lr:.2e} {dt * 100:.0f}ms/10it")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
