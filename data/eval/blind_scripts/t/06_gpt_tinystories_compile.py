"""
nanoGPT-style pretraining of a 124M GPT on TinyStories with DDP + torch.compile.

The corpus is tokenized with tiktoken (gpt2) once and cached as flat uint16
arrays under --cache_dir on the shared filesystem; later runs memory-map it.

    torchrun --standalone --nproc_per_node=8 06_gpt_tinystories_compile.py \
        --cache_dir /shared/cache/tinystories_gpt2 --out_dir runs/gpt124m_ts
"""
import argparse
import math
import os
import time

import numpy as np
import tiktoken
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--cache_dir", default="/shared/cache/tinystories_gpt2")
    p.add_argument("--out_dir", default="runs/gpt124m_ts")
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--total_batch_tokens", type=int, default=524288)
    p.add_argument("--max_iters", type=int, default=20000)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min_lr", type=float, default=6e-5)
    p.add_argument("--warmup", type=int, default=700)
    p.add_argument("--eval_interval", type=int, default=500)
    p.add_argument("--eval_iters", type=int, default=50)
    p.add_argument("--n_layer", type=int, default=12)
    p.add_argument("--n_head", type=int, default=12)
    p.add_argument("--n_embd", type=int, default=768)
    p.add_argument("--no_compile", action="store_true")
    return p.parse_args()


# ----------------------------------------------------------------------------- data

def build_token_cache(cache_dir):
    enc = tiktoken.get_encoding("gpt2")
    os.makedirs(cache_dir, exist_ok=True)
    for split in ("train", "validation"):
        ds = load_dataset("roneneldan/TinyStories", split=split)
        ds = ds.map(lambda ex: {"ids": enc.encode_ordinary(ex["text"]) + [enc.eot_token]},
                    remove_columns=["text"], num_proc=16)
        lens = np.array([len(x) for x in ds["ids"]], dtype=np.int64)
        arr = np.memmap(os.path.join(cache_dir, f"{split}.bin"), dtype=np.uint16, mode="w+", shape=(int(lens.sum()),))
        idx = 0
        for shard in range(64):
            chunk = ds.shard(64, shard, contiguous=True)
            toks = np.concatenate([np.asarray(x, dtype=np.uint16) for x in chunk["ids"]])
            arr[idx: idx + len(toks)] = toks
            idx += len(toks)
        arr.flush()


def get_batch(data, bs, block, device):
    ix = torch.randint(len(data) - block - 1, (bs,))
    x = torch.stack([torch.from_numpy(data[i:i + block].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


# ----------------------------------------------------------------------------- model

class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)
        self.h = h

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, block, n_layer, n_head, d):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.blocks = nn.ModuleList([Block(d, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.apply(self._init)
        for n, p in self.named_parameters():
            if n.endswith("proj.weight") or n.endswith("fc_out.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def lr_at(it, a):
    if it < a.warmup:
        return a.lr * (it + 1) / a.warmup
    r = min(1.0, (it - a.warmup) / (a.max_iters - a.warmup))
    return a.min_lr + 0.5 * (1 + math.cos(math.pi * r)) * (a.lr - a.min_lr)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{local_rank}"
    master = rank == 0
    torch.manual_seed(1337 + rank)
    torch.backends.cuda.matmul.allow_tf32 = True

    if not os.path.exists(os.path.join(args.cache_dir, "validation.bin")):
        build_token_cache(args.cache_dir)
    train_data = np.memmap(os.path.join(args.cache_dir, "train.bin"), dtype=np.uint16, mode="r")
    val_data = np.memmap(os.path.join(args.cache_dir, "validation.bin"), dtype=np.uint16, mode="r")

    tokens_per_micro = args.batch_size * args.block_size * world
    assert args.total_batch_tokens % tokens_per_micro == 0
    accum = args.total_batch_tokens // tokens_per_micro
    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"train tokens {len(train_data):,}  grad accum {accum}", flush=True)

    torch.manual_seed(1337)
    model = GPT(50304, args.block_size, args.n_layer, args.n_head, args.n_embd).to(device)
    torch.manual_seed(1337 + rank)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=True)

    start_iter = 0
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
        start_iter = ck["iter"] + 1

    if not args.no_compile:
        model = torch.compile(model)
    model = DDP(model, device_ids=[local_rank])
    raw = model.module._orig_mod if not args.no_compile else model.module

    @torch.no_grad()
    def estimate_loss():
        model.eval()
        out = {}
        for name, data in (("train", train_data), ("val", val_data)):
            losses = torch.zeros(args.eval_iters, device=device)
            for k in range(args.eval_iters):
                x, y = get_batch(data, args.batch_size, args.block_size, device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    _, loss = model(x, y)
                losses[k] = loss
            m = losses.mean()
            dist.all_reduce(m, op=dist.ReduceOp.AVG)
            out[name] = m.item()
        model.train()
        return out

    x, y = get_batch(train_data, args.batch_size, args.block_size, device)
    t0 = time.time()
    for it in range(start_iter, args.max_iters):
        lr = lr_at(it, args)
        for g in opt.param_groups:
            g["lr"] = lr

        if it % args.eval_interval == 0 and it > start_iter:
            losses = estimate_loss()
            if master:
                print(f"iter {it}: train {losses['train']:.4f} val {losses['val']:.4f}", flush=True)
                torch.save({"model": raw.state_dict(), "optim": opt.state_dict(), "iter": it, "args": vars(args)},
                           ckpt_path)

        loss_accum = torch.zeros((), device=device)
        for micro in range(accum):
            model.require_backward_grad_sync = micro == accum - 1
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(x, y)
                loss = loss / accum
            loss_accum += loss.detach()
            x, y = get_batch(train_data, args.batch_size, args.block_size, device)
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

        if it % 10 == 0:
            dist.all_reduce(loss_accum, op=dist.ReduceOp.AVG)
            torch.cuda.synchronize()
            dt = (time.time() - t0) / 10
            t0 = time.time()
            if master:
                print(f"iter {it} loss {loss_accum.item():.4f} norm {norm.item():.3f} lr {lr:.2e} "
                      f"{args.total_batch_tokens / dt:,.0f} tok/s", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
