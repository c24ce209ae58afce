"""
Tiny character-level GPT on tinyshakespeare, trained on the two gaming PCs.

prepare:  python prepare_shakespeare_char.py   (writes data/shakespeare_char/{train,val}.bin + meta.pkl
          on both machines)
train:
  pc1 (192.168.1.100, 4070 Ti):
    torchrun --nproc_per_node=1 --nnodes=2 --node_rank=0 --master_addr=192.168.1.100 --master_port=1234 chargpt_ddp.py
  pc2 (3060 Ti):
    torchrun --nproc_per_node=1 --nnodes=2 --node_rank=1 --master_addr=192.168.1.100 --master_port=1234 chargpt_ddp.py
"""
import argparse
import math
import os
import pickle
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class GPTConfig:
    block_size: int = 256
    vocab_size: int = 65
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.2


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.tok_emb.weight = self.head.weight  # weight tying
        self.apply(self._init)

    def _init(self, m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.cfg.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
        return idx


def get_batch(data, block_size, batch_size, device):
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


def get_lr(it, args):
    if it < args.warmup_iters:
        return args.lr * (it + 1) / args.warmup_iters
    if it > args.max_iters:
        return args.min_lr
    ratio = (it - args.warmup_iters) / (args.max_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


@torch.no_grad()
def estimate_loss(model, splits, args, device, ctx):
    model.eval()
    out = {}
    for name, data in splits.items():
        losses = torch.zeros(args.eval_iters, device=device)
        for k in range(args.eval_iters):
            x, y = get_batch(data, args.block_size, args.batch_size, device)
            with ctx:
                _, loss = model(x, y)
            losses[k] = loss
        mean = losses.mean()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        out[name] = mean.item()
    model.train()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="data/shakespeare_char")
    p.add_argument("--out-dir", default="out-shakespeare-char")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--max-iters", type=int, default=5000)
    p.add_argument("--warmup-iters", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--eval-interval", type=int, default=250)
    p.add_argument("--eval-iters", type=int, default=100)
    p.add_argument("--sample-tokens", type=int, default=300)
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    master = rank == 0
    device = f"cuda:{local_rank}"
    torch.manual_seed(args.seed + rank)  # different batches per rank
    # the 3060 Ti has bf16 too, both are Ampere or newer
    ctx = torch.autocast(device_type="cuda", dtype=torch.bfloat16)

    train_data = np.memmap(os.path.join(args.data_dir, "train.bin"), dtype=np.uint16, mode="r")
    val_data = np.memmap(os.path.join(args.data_dir, "val.bin"), dtype=np.uint16, mode="r")
    with open(os.path.join(args.data_dir, "meta.pkl"), "rb") as f:
        meta = pickle.load(f)
    stoi, itos = meta["stoi"], meta["itos"]

    cfg = GPTConfig(block_size=args.block_size, vocab_size=meta["vocab_size"])
    model = GPT(cfg).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.1)

    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{n_params / 1e6:.2f}M params, world size {dist.get_world_size()}")

    best_val = float("inf")
    t0 = time.time()
    for it in range(args.max_iters + 1):
        lr = get_lr(it, args)
        for group in optimizer.param_groups:
            group["lr"] = lr

        if it % args.eval_interval == 0:
            losses = estimate_loss(model, {"train": train_data, "val": val_data}, args, device, ctx)
            if master:
                print(f"step {it}: train {losses['train']:.4f}, val {losses['val']:.4f}")
                if losses["val"] < best_val:
                    best_val = losses["val"]
                    torch.save({"model": model.module.state_dict(), "cfg": cfg.__dict__,
                                "iter": it, "val": best_val},
                               os.path.join(args.out_dir, "ckpt.pt"))
                start = torch.tensor([[stoi["\n"]]], device=device)
                model.eval()
                with ctx:
                    sample = model.generate(start, args.sample_tokens, temperature=0.8, top_k=200)
                model.train()
                print("-" * 40)
                print("".join(itos[i] for i in sample[0].tolist()))
                print("-" * 40)

        x, y = get_batch(train_data, args.block_size, args.batch_size, device)
        with ctx:
            _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

        if master and it % 50 == 0:
            dt = time.time() - t0
            t0 = time.time()
            print(f"iter {it}: loss {loss.item():.4f} (rank0), lr {lr:.2e}, {dt * 1000 / 50:.0f}ms/it")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
