"""nanoGPT-style trainer for solo piano (GiantMIDI-Piano + ATEPP), pre-tokenized.

The corpus was tokenized offline (miditok REMI+, see tokenize_piano.py) into flat
uint16 streams train.bin / val.bin with EOS between pieces.

    torchrun --standalone --nproc_per_node=8 10_piano_nanogpt.py --config configs/piano_gpt_medium.yaml
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP

DEFAULTS = dict(
    data_dir="data/piano_remi",
    out_dir="out/piano_gpt",
    vocab_size=620,
    block_size=2048,
    n_layer=24, n_head=16, n_embd=1024, dropout=0.0,
    batch_size=8, grad_accum=4,
    max_iters=100_000, lr=3e-4, min_lr=3e-5, warmup_iters=2000, weight_decay=0.1,
    eval_interval=1000, eval_iters=100, log_interval=20,
    seed=1337,
)


class CausalSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.qkv = nn.Linear(c["n_embd"], 3 * c["n_embd"], bias=False)
        self.proj = nn.Linear(c["n_embd"], c["n_embd"], bias=False)
        self.n_head = c["n_head"]
        self.dropout = c["dropout"]

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c["n_embd"])
        self.attn = CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c["n_embd"])
        self.mlp = nn.Sequential(nn.Linear(c["n_embd"], 4 * c["n_embd"], bias=False), nn.GELU(),
                                 nn.Linear(4 * c["n_embd"], c["n_embd"], bias=False))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class PianoGPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte = nn.Embedding(c["vocab_size"], c["n_embd"])
        self.wpe = nn.Embedding(c["block_size"], c["n_embd"])
        self.blocks = nn.ModuleList(Block(c) for _ in range(c["n_layer"]))
        self.ln_f = nn.LayerNorm(c["n_embd"])
        self.lm_head = nn.Linear(c["n_embd"], c["vocab_size"], bias=False)
        self.wte.weight = self.lm_head.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx, targets=None):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def get_batch(data, block_size, batch_size, device, gen=None):
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=gen)
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


def lr_at(it, c):
    if it < c["warmup_iters"]:
        return c["lr"] * (it + 1) / c["warmup_iters"]
    ratio = (it - c["warmup_iters"]) / max(1, c["max_iters"] - c["warmup_iters"])
    return c["min_lr"] + 0.5 * (1 + math.cos(math.pi * min(1.0, ratio))) * (c["lr"] - c["min_lr"])


@torch.no_grad()
def estimate_val_loss(model, val_data, c, device, rank):
    """Fixed, rank-specific random windows so that successive evals are comparable."""
    model.eval()
    gen = torch.Generator().manual_seed(c["seed"] + 10_000 + rank)
    loss_sum, n = 0.0, 0
    for _ in range(c["eval_iters"]):
        x, y = get_batch(val_data, c["block_size"], c["batch_size"], device, gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss_sum += loss.item()
        n += 1
    stats = torch.tensor([loss_sum, n], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return (stats[0] / stats[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args()
    c = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            c.update(yaml.safe_load(f) or {})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{local_rank}"
    master = rank == 0
    torch.manual_seed(c["seed"] + rank)  # different batches per rank (random windows)
    torch.backends.cuda.matmul.allow_tf32 = True

    train_data = np.memmap(os.path.join(c["data_dir"], "train.bin"), dtype=np.uint16, mode="r")
    val_data = np.memmap(os.path.join(c["data_dir"], "val.bin"), dtype=np.uint16, mode="r")

    raw = PianoGPT(c).to(device)
    it0, best_val = 0, 1e9
    ckpt_path = os.path.join(c["out_dir"], "ckpt.pt")
    optimizer = torch.optim.AdamW(raw.parameters(), lr=c["lr"], betas=(0.9, 0.95),
                                  weight_decay=c["weight_decay"], fused=True)
    if a.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        raw.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        it0, best_val = ck["iter"] + 1, ck["best_val"]
    model = DDP(raw, device_ids=[local_rank])
    if master:
        os.makedirs(c["out_dir"], exist_ok=True)
        print(f"params {sum(p.numel() for p in raw.parameters()) / 1e6:.1f}M, "
              f"tokens/iter {c['batch_size'] * c['block_size'] * c['grad_accum'] * world}", flush=True)

    x, y = get_batch(train_data, c["block_size"], c["batch_size"], device)
    t0 = time.time()
    for it in range(it0, c["max_iters"]):
        for g in optimizer.param_groups:
            g["lr"] = lr_at(it, c)

        if it % c["eval_interval"] == 0 and it > it0:
            val_loss = estimate_val_loss(raw, val_data, c, device, rank)
            if master:
                print(f"iter {it}: val loss {val_loss:.4f}", flush=True)
                if val_loss < best_val:
                    best_val = val_loss
                    torch.save({"model": raw.state_dict(), "optimizer": optimizer.state_dict(),
                                "iter": it, "best_val": best_val, "config": c}, ckpt_path)
            dist.barrier()

        for micro in range(c["grad_accum"]):
            # only all-reduce gradients on the last micro step
            model.require_backward_grad_sync = micro == c["grad_accum"] - 1
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(x, y)
                loss = loss / c["grad_accum"]
            x, y = get_batch(train_data, c["block_size"], c["batch_size"], device)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if master and it % c["log_interval"] == 0:
            dt = time.time() - t0
            t0 = time.time()
            print(f"iter {it}: loss {loss.item() * c['grad_accum']:.4f}, {dt * 1000:.0f} ms, "
                  f"lr {lr_at(it, c):.2e}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
