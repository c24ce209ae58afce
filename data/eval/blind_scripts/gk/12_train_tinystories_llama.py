"""
Train a small Llama on TinyStories tokenized with a custom SentencePiece vocab
(see tinystories.py pretokenize --vocab_size=4096). Shards are flat uint16 .bin files.

    torchrun --standalone --nproc_per_node=4 train_tinystories.py --data_dir data/tok4096 --out_dir out/ts-4k
"""
import argparse
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


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


def precompute_freqs(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end).float()
    freqs = torch.outer(t, freqs)
    return torch.cos(freqs), torch.sin(freqs)


def apply_rotary(x, cos, sin):
    xr, xi = x.float().reshape(x.shape[:-1] + (-1, 2)).unbind(-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out_r = xr * cos - xi * sin
    out_i = xr * sin + xi * cos
    return torch.stack([out_r, out_i], dim=-1).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = apply_rotary(self.wq(x).view(B, T, self.n_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.wk(x).view(B, T, self.n_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(B, T, self.n_heads, self.head_dim)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).contiguous().view(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.attention = Attention(dim, n_heads)
        self.feed_forward = FeedForward(dim, 4 * dim * 2 // 3 // 32 * 32)
        self.attention_norm = RMSNorm(dim)
        self.ffn_norm = RMSNorm(dim)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, vocab_size, dim=512, n_layers=8, n_heads=8, max_seq_len=512):
        super().__init__()
        self.vocab_size = vocab_size
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, n_heads) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.tok_embeddings.weight = self.output.weight
        cos, sin = precompute_freqs(dim // n_heads, max_seq_len)
        self.register_buffer("freqs_cos", cos, persistent=False)
        self.register_buffer("freqs_sin", sin, persistent=False)
        for pn, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layers) if pn.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, tokens, targets):
        T = tokens.size(1)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.freqs_cos[:T], self.freqs_sin[:T])
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


class PretokLoader:
    """Random windows from this rank's subset of the shard files."""

    def __init__(self, files, batch_size, seq_len, seed):
        self.files = files
        self.batch_size, self.seq_len = batch_size, seq_len
        self.rng = np.random.default_rng(seed)
        self.tokens = [np.memmap(f, dtype=np.uint16, mode="r") for f in files]

    def next_batch(self):
        shard = self.tokens[self.rng.integers(len(self.tokens))]
        starts = self.rng.integers(0, len(shard) - self.seq_len - 1, size=self.batch_size)
        chunk = np.stack([shard[s: s + self.seq_len + 1] for s in starts]).astype(np.int64)
        chunk = torch.from_numpy(chunk).pin_memory().cuda(non_blocking=True)
        return chunk[:, :-1], chunk[:, 1:]


@torch.compile
def ns_orthogonalize(G, steps=5):
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    if X.size(0) > X.size(1):
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    if G.size(0) > G.size(1):
        X = X.T
    return X


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr=0.02, momentum=0.95):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "buf" not in st:
                    st["buf"] = torch.zeros_like(p.grad)
                st["buf"].lerp_(p.grad, 1 - group["momentum"])
                g = p.grad.lerp(st["buf"], group["momentum"])
                p.add_(ns_orthogonalize(g).type_as(p), alpha=-group["lr"] * max(1, p.size(0) / p.size(1)) ** 0.5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", default="data/tok4096")
    ap.add_argument("--out_dir", default="out/ts-4k")
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--seq_len", type=int, default=512)
    ap.add_argument("--max_iters", type=int, default=30000)
    ap.add_argument("--warmup_iters", type=int, default=1000)
    ap.add_argument("--adam_lr", type=float, default=5e-4)
    ap.add_argument("--muon_lr", type=float, default=0.02)
    ap.add_argument("--eval_interval", type=int, default=1000)
    ap.add_argument("--eval_windows", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=1337)
    args = ap.parse_args()

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    master = rank == 0
    torch.manual_seed(args.seed)

    shard_files = sorted(glob.glob(os.path.join(args.data_dir, "data*.bin")))
    val_file, train_files = shard_files[0], shard_files[1:]
    train_loader = PretokLoader(train_files[rank::world_size], args.batch_size, args.seq_len, args.seed + rank)
    val_tokens = np.memmap(val_file, dtype=np.uint16, mode="r")

    # vocab comes from the tokenizer used at pretokenization time; read it off the data
    vocab_size = int(max(t.max() for t in train_loader.tokens)) + 1
    if master:
        print(f"vocab size {vocab_size}, {len(train_files)} train shards, val shard {val_file}")

    model = Transformer(vocab_size, max_seq_len=args.seq_len).cuda()
    matrix_params = [p for n, p in model.layers.named_parameters() if p.ndim == 2]
    other_params = [model.tok_embeddings.weight] + [p for p in model.parameters() if p.ndim == 1]
    adam = torch.optim.AdamW(other_params, lr=args.adam_lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    muon = Muon(matrix_params, lr=args.muon_lr)
    optimizers = [adam, muon]
    base_lrs = [adam.param_groups[0]["lr"], muon.param_groups[0]["lr"]]

    model = DDP(torch.compile(model), device_ids=[local_rank])

    def lr_mult(it):
        if it < args.warmup_iters:
            return (it + 1) / args.warmup_iters
        ratio = (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(ratio, 1.0)))

    @torch.no_grad()
    def evaluate():
        model.eval()
        n_windows = args.eval_windows - args.eval_windows % (world_size * args.batch_size)
        total = torch.zeros((), device="cuda")
        count = 0
        for start in range(rank * args.batch_size, n_windows, world_size * args.batch_size):
            rows = [val_tokens[(start + j) * args.seq_len:(start + j + 1) * args.seq_len + 1] for j in range(args.batch_size)]
            chunk = torch.from_numpy(np.stack(rows).astype(np.int64)).cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                total += model(chunk[:, :-1], chunk[:, 1:])
            count += 1
        total /= count
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        model.train()
        return total.item()

    if master:
        os.makedirs(args.out_dir, exist_ok=True)
    best = float("inf")
    t0 = time.time()
    for it in range(args.max_iters + 1):
        if it % args.eval_interval == 0:
            vl = evaluate()
            if master:
                print(f"iter {it} val loss {vl:.4f}")
                if vl < best and it > 0:
                    best = vl
                    torch.save({"model": model.module._orig_mod.state_dict(), "vocab_size": vocab_size,
                                "iter": it, "val_loss": vl}, os.path.join(args.out_dir, "ckpt.pt"))
        if it == args.max_iters:
            break
        m = lr_mult(it)
        for opt, lr in zip(optimizers, base_lrs):
            for g in opt.param_groups:
                g["lr"] = lr * m
        x, y = train_loader.next_batch()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        if it % 100 == 0:
            lt = loss.detach()
            dist.all_reduce(lt, op=dist.ReduceOp.AVG)
            if master:
                print(f"iter {it} loss {lt.item():.4f} lr x{m:.3f} {(time.time() - t0) * 10:.1f}ms/it")
            t0 = time.time()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
