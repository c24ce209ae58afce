"""
Small char/BPE GPT trainer (nanoGPT style) with DDP, torch.compile and resume.

$ python 04_nanogpt_shakespeare_char.py --dataset shakespeare_char
$ torchrun --standalone --nproc_per_node=4 04_nanogpt_shakespeare_char.py --dataset openwebtext \
      --gradient_accumulation_steps 40 --compile
"""
import argparse
import math
import os
import pickle
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
from torch.distributed import barrier, destroy_process_group, init_process_group
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--dataset", default="shakespeare_char")
parser.add_argument("--out_dir", default="out")
parser.add_argument("--init_from", default="scratch", choices=["scratch", "resume"])
parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
parser.add_argument("--batch_size", type=int, default=64)
parser.add_argument("--block_size", type=int, default=256)
parser.add_argument("--n_layer", type=int, default=6)
parser.add_argument("--n_head", type=int, default=6)
parser.add_argument("--n_embd", type=int, default=384)
parser.add_argument("--dropout", type=float, default=0.2)
parser.add_argument("--learning_rate", type=float, default=1e-3)
parser.add_argument("--max_iters", type=int, default=5000)
parser.add_argument("--warmup_iters", type=int, default=100)
parser.add_argument("--min_lr", type=float, default=1e-4)
parser.add_argument("--eval_interval", type=int, default=250)
parser.add_argument("--eval_iters", type=int, default=200)
parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
parser.add_argument("--compile", action="store_true")
cfg = parser.parse_args()


class Block(nn.Module):
    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)
        self.ln2 = nn.LayerNorm(n_embd)
        self.ff = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.ff(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, dropout):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(n_embd, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.tok_emb.weight = self.head.weight

    def forward(self, idx, targets=None):
        T = idx.size(1)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device)))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def estimate_mfu(self, fwdbwd_per_iter, dt):
        N = sum(p.numel() for p in self.parameters())
        L, H, Q, T = len(self.blocks), self.blocks[0].n_head, self.tok_emb.embedding_dim, self.block_size
        flops_per_token = 6 * N + 12 * L * H * (Q // H) * T
        flops_achieved = flops_per_token * T * fwdbwd_per_iter / dt
        return flops_achieved / 312e12


ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend="nccl")
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    device = f"cuda:{ddp_local_rank}"
    torch.cuda.set_device(device)
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    assert cfg.gradient_accumulation_steps % ddp_world_size == 0
    cfg.gradient_accumulation_steps //= ddp_world_size
else:
    master_process, seed_offset, ddp_world_size = True, 0, 1
    device = "cuda"
tokens_per_iter = cfg.gradient_accumulation_steps * ddp_world_size * cfg.batch_size * cfg.block_size
if master_process:
    print(f"tokens per iteration will be: {tokens_per_iter:,}")
    os.makedirs(cfg.out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.dtype]
ctx = nullcontext() if cfg.dtype == "float32" else torch.amp.autocast(device_type="cuda", dtype=ptdtype)

data_dir = os.path.join("data", cfg.dataset)


def get_batch(split):
    # re-open the memmap every call to avoid the np.memmap leak
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - cfg.block_size, (cfg.batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + cfg.block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + cfg.block_size].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


meta_path = os.path.join(data_dir, "meta.pkl")
vocab_size = 50304
if os.path.exists(meta_path):
    with open(meta_path, "rb") as f:
        vocab_size = pickle.load(f)["vocab_size"]

iter_num, best_val_loss = 0, 1e9
model = GPT(vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.dropout)
checkpoint = None
if cfg.init_from == "resume":
    checkpoint = torch.load(os.path.join(cfg.out_dir, "ckpt.pt"), map_location=device)
    state = checkpoint["model"]
    for k in list(state.keys()):
        if k.startswith("_orig_mod."):
            state[k[len("_orig_mod."):]] = state.pop(k)
    model.load_state_dict(state)
    iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
model.to(device)

scaler = torch.cuda.amp.GradScaler(enabled=(cfg.dtype == "float16"))
optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, betas=(0.9, 0.99), weight_decay=0.1)
if checkpoint is not None:
    optimizer.load_state_dict(checkpoint["optimizer"])
    scaler.load_state_dict(checkpoint["scaler"])
checkpoint = None

if cfg.compile:
    model = torch.compile(model)
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank])
raw_model = model.module if ddp else model


@torch.no_grad()
def estimate_loss():
    out = {}
    raw_model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(cfg.eval_iters)
        for k in range(cfg.eval_iters):
            X, Y = get_batch(split)
            with ctx:
                _, loss = raw_model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    raw_model.train()
    return out


def get_lr(it):
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    ratio = min(1.0, (it - cfg.warmup_iters) / (cfg.max_iters - cfg.warmup_iters))
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


X, Y = get_batch("train")
t0 = time.time()
local_iter_num, running_mfu = 0, -1.0
while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr

    if iter_num % cfg.eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if losses["val"] < best_val_loss or iter_num == 0:
            best_val_loss = losses["val"]
            if iter_num > 0:
                torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                            "scaler": scaler.state_dict(), "iter_num": iter_num,
                            "best_val_loss": best_val_loss, "config": vars(cfg)},
                           os.path.join(cfg.out_dir, "ckpt.pt"))

    for micro_step in range(cfg.gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = (micro_step == cfg.gradient_accumulation_steps - 1)
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / cfg.gradient_accumulation_steps
        X, Y = get_batch("train")
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if iter_num % 10 == 0 and master_process:
        lossf = loss.item() * cfg.gradient_accumulation_steps
        if local_iter_num >= 5:
            mfu = raw_model.estimate_mfu(cfg.batch_size * cfg.gradient_accumulation_steps, dt)
            running_mfu = mfu if running_mfu == -1.0 else 0.9 * running_mfu + 0.1 * mfu
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, mfu {running_mfu * 100:.2f}%")
    iter_num += 1
    local_iter_num += 1
    if iter_num > cfg.max_iters:
        break

if ddp:
    barrier()
    destroy_process_group()
