"""Multi-epoch pretraining of a small code LM on a packed token corpus (~2B tokens).

Samples are fixed (seq_len+1)-token chunks of the concatenated corpus; the run does
several passes over the data.

    torchrun --standalone --nproc_per_node=8 10_stack_py_codelm.py --data /data/stack-py/tokens.bin --epochs 4
"""
import os
import math
import time
import argparse
import logging

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP

logger = logging.getLogger(__name__)


class PackedChunks(Dataset):
    def __init__(self, path, seq_len, start=0.0, end=1.0):
        self.path, self.seq_len = path, seq_len
        n_tokens = os.path.getsize(path) // 2
        n_chunks = (n_tokens - 1) // seq_len
        self.lo, self.hi = int(n_chunks * start), int(n_chunks * end)
        self._mm = None

    def __len__(self):
        return self.hi - self.lo

    def __getitem__(self, i):
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint16, mode="r")
        s = (self.lo + i) * self.seq_len
        return torch.from_numpy(self._mm[s:s + self.seq_len + 1].astype(np.int64))


class DecoderLayer(nn.Module):
    def __init__(self, d, heads, mult=4):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.norm2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, mult * d, bias=False), nn.GELU(), nn.Linear(mult * d, d, bias=False))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(B, T, D))
        return x + self.ff(self.norm2(x))


class CodeLM(nn.Module):
    def __init__(self, vocab, seq_len, d, heads, layers):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq_len, d)
        self.layers = nn.ModuleList(DecoderLayer(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, x):
        h = self.tok(x) + self.pos(torch.arange(x.size(1), device=x.device))
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="out/code-lm")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--d_model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--warmup_iters", type=int, default=1000)
    p.add_argument("--val_frac", type=float, default=0.002)
    p.add_argument("--eval_every", type=int, default=500)
    p.add_argument("--eval_batches", type=int, default=25)
    p.add_argument("--workers", type=int, default=6)
    args = p.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO if rank == 0 else logging.ERROR)

    train_ds = PackedChunks(args.data, args.seq_len, 0.0, 1.0 - args.val_frac)
    val_ds = PackedChunks(args.data, args.seq_len, 1.0 - args.val_frac, 1.0)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=17, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, prefetch_factor=4, persistent_workers=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, num_workers=2,
                            pin_memory=True, drop_last=True)

    iters_per_epoch = len(train_loader) // args.accum
    total_iters = iters_per_epoch * args.epochs
    tokens_per_iter = args.batch_size * args.seq_len * args.accum * world
    logger.info("train chunks %d, iters/epoch %d, total iters %d, tokens/iter %d",
                len(train_ds), iters_per_epoch, total_iters, tokens_per_iter)

    torch.manual_seed(0)
    model = CodeLM(args.vocab, args.seq_len, args.d_model, args.heads, args.layers).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    model = DDP(torch.compile(model), device_ids=[local_rank])

    def lr_at(it):
        if it < args.warmup_iters:
            return args.lr * (it + 1) / args.warmup_iters
        frac = (it - args.warmup_iters) / max(1, total_iters - args.warmup_iters)
        return args.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(frac, 1.0))))

    @torch.no_grad()
    def evaluate():
        model.eval()
        s = torch.zeros(2, device=device)
        for i, b in enumerate(val_loader):
            if i == args.eval_batches:
                break
            b = b.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(b[:, :-1])
            s[0] += F.cross_entropy(logits.float().flatten(0, 1), b[:, 1:].flatten(), reduction="sum")
            s[1] += b[:, 1:].numel()
        dist.all_reduce(s)
        model.train()
        return (s[0] / s[1]).item()

    it = 0
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        micro = 0
        opt.zero_grad(set_to_none=True)  # drop a partial accumulation left over from the previous epoch
        for batch in train_loader:
            batch = batch.to(device, non_blocking=True)
            last_micro = (micro + 1) % args.accum == 0
            model.require_backward_grad_sync = last_micro
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
            (loss / args.accum).backward()
            micro += 1
            if not last_micro:
                continue

            for g in opt.param_groups:
                g["lr"] = lr_at(it)
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            it += 1

            if it % 20 == 0:
                torch.cuda.synchronize()
                dt = (time.time() - t0) / 20
                t0 = time.time()
                tok_s = tokens_per_iter / dt
                mfu = 6 * n_params * tok_s / world / 989e12
                logger.info("ep %d it %d/%d loss %.4f gnorm %.2f lr %.2e %.0f tok/s mfu %.1f%%", epoch, it,
                            total_iters, loss.item(), gnorm.item(), opt.param_groups[0]["lr"], tok_s, mfu * 100)
            if it % args.eval_every == 0:
                logger.info("ep %d it %d val_loss %.4f", epoch, it, evaluate())

        if rank == 0:
            torch.save({"model": model.module._orig_mod.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch, "it": it, "args": vars(args)},
                       os.path.join(args.out, f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
