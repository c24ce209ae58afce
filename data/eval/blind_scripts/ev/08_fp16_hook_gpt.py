"""GPT-style LM (124M) with fp16-compressed gradient all-reduce.

DDP + fp16_compress_hook, gradient accumulation with no_sync, global-norm
clipping, cosine LR. Batches are random windows of a uint16 token file.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        fp16_hook_gpt.py --data /mnt/shared/owt --out /mnt/shared/runs/gpt_fp16hook
"""
import argparse
import contextlib
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


class CausalSelfAttention(nn.Module):
    def __init__(self, d, n_head, dropout):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.n_head = n_head
        self.dropout = dropout

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, d, n_head, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_head, dropout)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=50304, block_size=1024, n_layer=12, n_head=12, d=768, dropout=0.0):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList([Block(d, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


class RandomWindows:
    """Random (x, y) windows from a token file; each rank draws from its own generator."""

    def __init__(self, path, block_size, batch_size, seed, device):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.block_size = block_size
        self.batch_size = batch_size
        self.rng = np.random.default_rng(seed)
        self.device = device

    def get(self):
        ix = self.rng.integers(0, len(self.data) - self.block_size - 1, size=self.batch_size)
        x = torch.from_numpy(np.stack([self.data[i:i + self.block_size].astype(np.int64) for i in ix]))
        y = torch.from_numpy(np.stack([self.data[i + 1:i + 1 + self.block_size].astype(np.int64) for i in ix]))
        return (x.pin_memory().to(self.device, non_blocking=True),
                y.pin_memory().to(self.device, non_blocking=True))


def get_lr(it, args):
    if it < args.warmup_iters:
        return args.lr * (it + 1) / args.warmup_iters
    ratio = min(1.0, (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters))
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


@torch.no_grad()
def estimate_val_loss(raw_model, val, iters, device):
    raw_model.eval()
    total = torch.zeros((), device=device)
    for _ in range(iters):
        x, y = val.get()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = raw_model(x, y)
        total += loss.float()
    raw_model.train()
    total /= iters
    dist.all_reduce(total, op=dist.ReduceOp.AVG)
    return total.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="folder with train.bin / val.bin")
    ap.add_argument("--out", required=True)
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=12)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--min-lr", type=float, default=6e-5)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--warmup-iters", type=int, default=2000)
    ap.add_argument("--max-iters", type=int, default=100000)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--eval-iters", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1337)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    master = rank == 0
    torch.manual_seed(args.seed)

    # different windows on every rank; the model init is the same seed everywhere (and DDP broadcasts it anyway)
    train = RandomWindows(os.path.join(args.data, "train.bin"), args.block_size, args.micro_batch,
                          args.seed + rank, device)
    val = RandomWindows(os.path.join(args.data, "val.bin"), args.block_size, args.micro_batch,
                        10_000 + rank, device)

    raw_model = GPT(block_size=args.block_size).to(device)
    model = DDP(raw_model, device_ids=[local_rank])
    model.register_comm_hook(state=None, hook=default_hooks.fp16_compress_hook)

    decay = [p for n, p in raw_model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in raw_model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), fused=True)

    it = 0
    ckpt_path = os.path.join(args.out, "ckpt.pt")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        raw_model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        it = ckpt["iter"]
    if master:
        os.makedirs(args.out, exist_ok=True)
        tok_per_it = args.micro_batch * args.block_size * args.accum * world
        print(f"world {world}, tokens/iter {tok_per_it:,}, starting at iter {it}", flush=True)

    t0 = time.time()
    while it < args.max_iters:
        lr = get_lr(it, args)
        for g in optimizer.param_groups:
            g["lr"] = lr

        for micro in range(args.accum):
            x, y = train.get()
            # only the last micro-step all-reduces; the earlier ones accumulate locally
            sync_ctx = model.no_sync() if micro < args.accum - 1 else contextlib.nullcontext()
            with sync_ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    _, loss = model(x, y)
                (loss / args.accum).backward()

        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        it += 1

        if it % 100 == 0 and master:
            dt = (time.time() - t0) / 100
            t0 = time.time()
            print(f"iter {it} loss {loss.item():.4f} gnorm {gnorm.item():.3f} lr {lr:.2e} {dt * 1000:.0f}ms/it",
                  flush=True)

        if it % args.eval_every == 0 or it == args.max_iters:
            vloss = estimate_val_loss(raw_model, val, args.eval_iters, device)
            if master:
                print(f"iter {it} val loss {vloss:.4f}", flush=True)
                torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                            "iter": it, "args": vars(args)}, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
