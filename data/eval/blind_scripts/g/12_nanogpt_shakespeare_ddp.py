# Char-level GPT on tiny-shakespeare.
# Started from the "let's build GPT" tutorial notebook, moved to a script and extended with DDP
# so I can use the lab's 4-GPU box.
#   torchrun --standalone --nproc_per_node=4 12_nanogpt_shakespeare_ddp.py
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

# ---------------- hyperparameters ----------------
batch_size = 64          # per GPU
block_size = 256
max_iters = 5000
eval_interval = 500
eval_iters = 200
learning_rate = 3e-4
n_embd = 384
n_head = 6
n_layer = 6
dropout = 0.2
data_path = "data/input.txt"
out_dir = "out-shakespeare-char"
device = "cuda:0" if torch.cuda.is_available() else "cpu"
# --------------------------------------------------


def load_data(path):
    with open(path, "r", encoding="utf-8") as f:
        text = f.read()
    chars = sorted(list(set(text)))
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    n = int(0.9 * len(data))
    return data[:n], data[n:], stoi, itos


def get_batch(data, gen):
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=gen)
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + block_size + 1] for i in ix])
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


class Head(nn.Module):
    def __init__(self, head_size):
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        k, q, v = self.key(x), self.query(x), self.value(x)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             dropout_p=dropout if self.training else 0.0)
        return out


class MultiHeadAttention(nn.Module):
    def __init__(self, num_heads, head_size):
        super().__init__()
        self.heads = nn.ModuleList([Head(head_size) for _ in range(num_heads)])
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.proj(torch.cat([h(x) for h in self.heads], dim=-1)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.sa = MultiHeadAttention(n_head, n_embd // n_head)
        self.ffwd = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                  nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))
        self.ln1 = nn.LayerNorm(n_embd)
        self.ln2 = nn.LayerNorm(n_embd)

    def forward(self, x):
        x = x + self.sa(self.ln1(x))
        return x + self.ffwd(self.ln2(x))


class GPTLanguageModel(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.token_embedding_table = nn.Embedding(vocab_size, n_embd)
        self.position_embedding_table = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[Block() for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.token_embedding_table(idx) + self.position_embedding_table(pos)
        logits = self.lm_head(self.ln_f(self.blocks(x)))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(B * T, -1), targets.view(B * T))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens):
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -block_size:])
            probs = F.softmax(logits[:, -1, :], dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
        return idx


@torch.no_grad()
def estimate_loss(model, train_data, val_data, gen):
    out = {}
    model.eval()
    for split, data in (("train", train_data), ("val", val_data)):
        losses = torch.zeros(eval_iters, device=device)
        for k in range(eval_iters):
            X, Y = get_batch(data, gen)
            _, loss = model(X, Y)
            losses[k] = loss
        mean = losses.mean()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        out[split] = mean.item()
    model.train()
    return out


def get_lr(it, warmup=200):
    if it < warmup:
        return learning_rate * (it + 1) / warmup
    ratio = (it - warmup) / max(1, max_iters - warmup)
    return 0.1 * learning_rate + 0.45 * learning_rate * (1 + math.cos(math.pi * ratio))


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    master = rank == 0

    torch.manual_seed(1337)
    gen = torch.Generator().manual_seed(1337 + rank)   # different batches on each rank
    train_data, val_data, stoi, itos = load_data(data_path)

    model = GPTLanguageModel(len(stoi)).to(device)
    model = DDP(model, device_ids=[local_rank])
    raw_model = model.module
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    if master:
        os.makedirs(out_dir, exist_ok=True)
        print(f"{sum(p.numel() for p in raw_model.parameters()) / 1e6:.2f}M params, world {world_size}")

    t0 = time.time()
    for it in range(max_iters):
        for g in optimizer.param_groups:
            g["lr"] = get_lr(it)

        if it % eval_interval == 0 or it == max_iters - 1:
            losses = estimate_loss(raw_model, train_data, val_data, gen)
            if master:
                print(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f} "
                      f"({time.time() - t0:.0f}s)", flush=True)
                torch.save({"model": raw_model.state_dict(), "stoi": stoi, "itos": itos, "iter": it},
                           os.path.join(out_dir, "ckpt.pt"))

        xb, yb = get_batch(train_data, gen)
        _, loss = model(xb, yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    if master:
        ctx = torch.zeros((1, 1), dtype=torch.long, device=device)
        sample = raw_model.generate(ctx, max_new_tokens=500)[0].tolist()
        print("".join(itos[i] for i in sample))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
