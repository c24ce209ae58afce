"""
GPT-2 small reproduction. Started on a single A100 (python 18_gpt2_small_repro.py),
now run on a full node:

    torchrun --standalone --nproc_per_node=8 18_gpt2_small_repro.py
"""
import os
import math
import time
import argparse
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--data_dir", default="data/openwebtext")
parser.add_argument("--out_dir", default="out-gpt2")
parser.add_argument("--batch_size", type=int, default=8)
parser.add_argument("--block_size", type=int, default=1024)
parser.add_argument("--gradient_accumulation_steps", type=int, default=64)
parser.add_argument("--learning_rate", type=float, default=6e-4)
parser.add_argument("--min_lr", type=float, default=6e-5)
parser.add_argument("--warmup_iters", type=int, default=2000)
parser.add_argument("--lr_decay_iters", type=int, default=600000)
parser.add_argument("--max_iters", type=int, default=600000)
parser.add_argument("--eval_interval", type=int, default=2000)
parser.add_argument("--eval_iters", type=int, default=200)
parser.add_argument("--log_interval", type=int, default=10)
parser.add_argument("--compile", type=int, default=1)
args = parser.parse_args()


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.attn_proj(y)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("attn_proj.weight", "c_proj.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for blk in self.h:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    dist.init_process_group(backend="nccl")
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    device = f"cuda:{ddp_local_rank}"
    torch.cuda.set_device(device)
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
else:
    ddp_rank, ddp_local_rank, ddp_world_size = 0, 0, 1
    master_process, seed_offset = True, 0
    device = "cuda"

grad_accum = args.gradient_accumulation_steps
tokens_per_iter = grad_accum * ddp_world_size * args.batch_size * args.block_size
if master_process:
    print(f"tokens per iteration will be: {tokens_per_iter:,}")
    os.makedirs(args.out_dir, exist_ok=True)

torch.manual_seed(1337 + seed_offset)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
ctx = torch.autocast(device_type="cuda", dtype=torch.bfloat16)


def get_batch(split):
    data = np.memmap(os.path.join(args.data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - args.block_size, (args.batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + args.block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + args.block_size].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


model = GPT(block_size=args.block_size).to(device)
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=args.learning_rate, betas=(0.9, 0.95), fused=True)
raw_model = model
if args.compile:
    model = torch.compile(model)
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank])
n_params = sum(p.numel() for p in raw_model.parameters())


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(args.eval_iters, device=device)
        for k in range(args.eval_iters):
            X, Y = get_batch(split)
            with ctx:
                _, loss = model(X, Y)
            losses[k] = loss
        m = losses.mean()
        if ddp:
            dist.all_reduce(m, op=dist.ReduceOp.AVG)
        out[split] = m.item()
    model.train()
    return out


def get_lr(it):
    if it < args.warmup_iters:
        return args.learning_rate * (it + 1) / (args.warmup_iters + 1)
    if it > args.lr_decay_iters:
        return args.min_lr
    decay_ratio = (it - args.warmup_iters) / (args.lr_decay_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (args.learning_rate - args.min_lr)


iter_num = 0
best_val_loss = 1e9
X, Y = get_batch("train")
t0 = time.time()
while iter_num <= args.max_iters:
    lr = get_lr(iter_num)
    for pg in optimizer.param_groups:
        pg["lr"] = lr

    if iter_num % args.eval_interval == 0:
        losses = estimate_loss()
        if master_process:
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if iter_num > 0 and losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                            "iter_num": iter_num, "best_val_loss": best_val_loss, "args": vars(args)},
                           os.path.join(args.out_dir, "ckpt.pt"))

    for micro_step in range(grad_accum):
        sync = micro_step == grad_accum - 1
        with (model.no_sync() if ddp and not sync else nullcontext()):
            with ctx:
                _, loss = model(X, Y)
                loss = loss / grad_accum
            X, Y = get_batch("train")
            loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    if iter_num % args.log_interval == 0 and master_process:
        torch.cuda.synchronize()
        t1 = time.time()
        dt = (t1 - t0) / (args.log_interval if iter_num else 1)
        t0 = t1
        tok_s = tokens_per_iter / dt
        mfu = 6 * n_params * tok_s / (ddp_world_size * 312e12)
        print(f"iter {iter_num}: loss {loss.item() * grad_accum:.4f}, lr {lr:.2e}, "
              f"{dt*1000:.0f}ms, {tok_s:,.0f} tok/s, mfu {mfu*100:.1f}%")
    iter_num += 1

if ddp:
    dist.destroy_process_group()
