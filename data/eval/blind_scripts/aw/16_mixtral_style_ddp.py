"""Small Mixtral-style sparse MoE decoder trained from scratch with DDP.

Experts are replicated on every GPU (the model is small enough); routing is
top-2 over 8 SwiGLU experts with the Switch/Mixtral load-balancing loss.

    torchrun --nproc_per_node=4 16_mixtral_style_ddp.py --train data/tinystories_train.bin \
        --val data/tinystories_val.bin --run-name moe8x2
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_config():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--run-name", default="moe")
    p.add_argument("--out-dir", default="runs")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--router-aux-coef", type=float, default=0.02)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--max-iters", type=int, default=20000)
    p.add_argument("--eval-interval", type=int, default=500)
    p.add_argument("--eval-iters", type=int, default=100)
    return p.parse_args()


class TokenFile(Dataset):
    def __init__(self, path, ctx):
        self.d = np.memmap(path, dtype=np.uint16, mode="r")
        self.ctx = ctx

    def __len__(self):
        return (len(self.d) - 1) // self.ctx

    def __getitem__(self, i):
        x = torch.from_numpy(self.d[i * self.ctx:(i + 1) * self.ctx + 1].astype(np.int64))
        return x[:-1], x[1:]


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.w, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        return self.w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class SwiGLU(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.k, self.E = cfg.top_k, cfg.experts
        self.gate = nn.Linear(cfg.dim, cfg.experts, bias=False)
        self.experts = nn.ModuleList([SwiGLU(cfg.dim, cfg.ffn) for _ in range(cfg.experts)])
        self.router_logits = None

    def forward(self, x):
        B, T, D = x.shape
        x = x.view(-1, D)
        logits = self.gate(x)
        self.router_logits = logits
        w, sel = torch.topk(logits.float().softmax(-1), self.k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(sel == e)
            # an expert with no tokens still runs on an empty batch, so every
            # parameter is part of the graph each step
            out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
        return out.view(B, T, D)


def load_balancing_loss(router_logits, num_experts, top_k):
    probs = torch.cat(router_logits, 0).float().softmax(-1)
    _, sel = probs.topk(top_k, -1)
    tokens_per_expert = F.one_hot(sel, num_experts).float().mean(0)
    return num_experts * (tokens_per_expert * probs.mean(0)).sum()


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.h = cfg.heads
        self.n1, self.n2 = RMSNorm(cfg.dim), RMSNorm(cfg.dim)
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.moe = SparseMoE(cfg)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.h, -1).transpose(1, 2) for t in self.wqkv(self.n1(x)).chunk(3, -1))
        x = x + self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D))
        return x + self.moe(self.n2(x))


class MoETransformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.ctx, cfg.dim)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.layers)])
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.tok.weight = self.head.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))

    def load_balancing_loss(self):
        logits = [b.moe.router_logits for b in self.blocks]
        return load_balancing_loss(logits, self.cfg.experts, self.cfg.top_k)


@torch.no_grad()
def estimate_loss(model, loader, iters, device):
    model.eval()
    s = torch.zeros(2, device=device)
    for i, (x, y) in enumerate(loader):
        if i >= iters:
            break
        x, y = x.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        s[0] += F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        s[1] += 1
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    cfg = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")
    out_dir = os.path.join(cfg.out_dir, cfg.run_name)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    train_ds, val_ds = TokenFile(cfg.train, cfg.ctx), TokenFile(cfg.val, cfg.ctx)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, cfg.batch_size, sampler=train_sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, cfg.batch_size, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=2, drop_last=True)

    torch.manual_seed(1337)
    model = MoETransformer(cfg).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = 1000
    get_lr = lambda it: cfg.lr * min(1.0, (it + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(it, cfg.max_iters) / cfg.max_iters)))

    it, epoch, best_val = 0, 0, float("inf")
    t0 = time.time()
    while it < cfg.max_iters:
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            for g in optimizer.param_groups:
                g["lr"] = get_lr(it)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
                ce = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
                aux = model.load_balancing_loss()
                loss = ce + cfg.router_aux_coef * aux
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            it += 1

            if it % 50 == 0 and rank == 0:
                print(f"iter {it} ce {ce.item():.4f} aux {aux.item():.4f} lr {get_lr(it):.2e} "
                      f"{(time.time() - t0) * 20:.0f}ms/it", flush=True)
                t0 = time.time()
            if it % cfg.eval_interval == 0:
                val = estimate_loss(model, val_loader, cfg.eval_iters, device)
                if rank == 0:
                    print(f"iter {it} val loss {val:.4f}", flush=True)
                    if val < best_val:
                        best_val = val
                        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                    "iter": it, "config": vars(cfg), "val": val}, os.path.join(out_dir, "ckpt.pt"))
            if it >= cfg.max_iters:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
