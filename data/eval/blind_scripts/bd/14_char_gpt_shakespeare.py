"""
Character-level GPT on tiny-shakespeare, multi-GPU with DDP.
(my re-implementation after watching "Let's build GPT: from scratch")

    torchrun --standalone --nproc_per_node=4 14_char_gpt_shakespeare.py --max_iters 5000

Each process samples its own random batches (seeded differently per rank),
gradients are accumulated over --grad_accum micro-batches with no_sync().
"""
import os
import math
import time
import argparse
import contextlib
import urllib.request

import torch
import torch.nn as nn
from torch.nn import functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

DATA_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"

parser = argparse.ArgumentParser()
parser.add_argument("--data_path", default="data/input.txt")
parser.add_argument("--out_dir", default="out-shakespeare-char")
parser.add_argument("--batch_size", type=int, default=32)        # per GPU, per micro step
parser.add_argument("--block_size", type=int, default=256)
parser.add_argument("--grad_accum", type=int, default=2)
parser.add_argument("--max_iters", type=int, default=5000)
parser.add_argument("--eval_interval", type=int, default=250)
parser.add_argument("--eval_iters", type=int, default=50)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--n_embd", type=int, default=384)
parser.add_argument("--n_head", type=int, default=6)
parser.add_argument("--n_layer", type=int, default=6)
parser.add_argument("--dropout", type=float, default=0.2)
parser.add_argument("--seed", type=int, default=1337)


# ------------------------------------------------------------------ model
class Head(nn.Module):
    def __init__(self, n_embd, head_size, block_size, dropout):
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.shape
        k, q = self.key(x), self.query(x)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        wei = self.dropout(F.softmax(wei, dim=-1))
        return wei @ self.value(x)


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size, dropout):
        super().__init__()
        hs = n_embd // n_head
        self.heads = nn.ModuleList([Head(n_embd, hs, block_size, dropout) for _ in range(n_head)])
        self.proj = nn.Linear(n_embd, n_embd)
        self.ffwd = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                  nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))
        self.ln1 = nn.LayerNorm(n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.drop(self.proj(torch.cat([head(h) for head in self.heads], dim=-1)))
        return x + self.ffwd(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, n_embd, n_head, n_layer, block_size, dropout):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head, block_size, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))
        logits = self.lm_head(self.ln_f(self.blocks(x)))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(B * T, -1), targets.view(B * T))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens):
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.block_size:])
            probs = F.softmax(logits[:, -1, :], dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
        return idx


# ------------------------------------------------------------------ main
def main():
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    master = rank == 0

    # different seed per rank -> different random batches on every GPU.
    # the weights are still identical: DDP copies rank 0's parameters at construction.
    torch.manual_seed(args.seed + rank)

    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        if not os.path.exists(args.data_path):
            os.makedirs(os.path.dirname(args.data_path), exist_ok=True)
            urllib.request.urlretrieve(DATA_URL, args.data_path)
    dist.barrier()

    with open(args.data_path, "r", encoding="utf-8") as f:
        text = f.read()
    chars = sorted(list(set(text)))
    vocab_size = len(chars)
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}
    encode = lambda s: [stoi[c] for c in s]
    decode = lambda l: "".join(itos[i] for i in l)

    data = torch.tensor(encode(text), dtype=torch.long)
    n = int(0.9 * len(data))
    splits = {"train": data[:n], "val": data[n:]}

    def get_batch(split):
        d = splits[split]
        ix = torch.randint(len(d) - args.block_size, (args.batch_size,))
        x = torch.stack([d[i:i + args.block_size] for i in ix])
        y = torch.stack([d[i + 1:i + args.block_size + 1] for i in ix])
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)

    model = GPT(vocab_size, args.n_embd, args.n_head, args.n_layer, args.block_size, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    raw_model = model.module
    if master:
        print(f"{sum(p.numel() for p in raw_model.parameters()) / 1e6:.2f}M parameters, vocab {vocab_size}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scaler = torch.cuda.amp.GradScaler()
    warmup = 100

    def lr_for(it):
        if it < warmup:
            return args.lr * (it + 1) / warmup
        ratio = (it - warmup) / max(1, args.max_iters - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * ratio)))

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ["train", "val"]:
            losses = torch.zeros(args.eval_iters, device=device)
            for k in range(args.eval_iters):
                X, Y = get_batch(split)
                with torch.autocast(device_type="cuda", dtype=torch.float16):
                    _, loss = raw_model(X, Y)
                losses[k] = loss
            mean = losses.mean()
            dist.all_reduce(mean, op=dist.ReduceOp.SUM)
            out[split] = (mean / world).item()
        model.train()
        return out

    best_val = float("inf")
    t0 = time.time()
    for it in range(args.max_iters + 1):
        for g in optimizer.param_groups:
            g["lr"] = lr_for(it)

        if it % args.eval_interval == 0:
            losses = estimate_loss()   # every rank runs this (it all-reduces)
            if master:
                print(f"step {it}: train {losses['train']:.4f}, val {losses['val']:.4f}, "
                      f"{time.time() - t0:.1f}s")
                if losses["val"] < best_val:
                    best_val = losses["val"]
                    torch.save({"model": raw_model.state_dict(), "chars": chars, "iter": it,
                                "args": vars(args)}, os.path.join(args.out_dir, "ckpt.pt"))
        if it == args.max_iters:
            break

        for micro in range(args.grad_accum):
            X, Y = get_batch("train")
            last = micro == args.grad_accum - 1
            # only all-reduce gradients on the last micro step
            ctx = contextlib.nullcontext() if last else model.no_sync()
            with ctx:
                with torch.autocast(device_type="cuda", dtype=torch.float16):
                    _, loss = model(X, Y)
                scaler.scale(loss / args.grad_accum).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    if master:
        ctx_idx = torch.zeros((1, 1), dtype=torch.long, device=device)
        print(decode(raw_model.generate(ctx_idx, max_new_tokens=500)[0].tolist()))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
