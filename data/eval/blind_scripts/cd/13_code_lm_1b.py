"""
Code LM pretraining (1.1B) on tokenized GitHub data, packed 4k sequences.

    torchrun --standalone --nproc_per_node=8 13_code_lm_1b.py \
        --train_bin /data/code/train.bin --val_bin /data/code/val.bin --save_dir /ckpt/code-1b
"""
import os
import math
import time
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


def get_parser():
    parser = argparse.ArgumentParser(description="code LM pretraining")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0)
    parser.add_argument("--train_bin", type=str, required=True)
    parser.add_argument("--val_bin", type=str, required=True)
    parser.add_argument("--save_dir", type=str, default="ckpt/code-1b")
    parser.add_argument("--seq_len", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv_heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--micro_batch", type=int, default=2)
    parser.add_argument("--grad_accum", type=int, default=16)
    parser.add_argument("--lr", type=float, default=4e-4)
    parser.add_argument("--min_lr", type=float, default=4e-5)
    parser.add_argument("--warmup_steps", type=int, default=2000)
    parser.add_argument("--total_steps", type=int, default=150000)
    parser.add_argument("--eval_every", type=int, default=1000)
    parser.add_argument("--eval_steps", type=int, default=50)
    parser.add_argument("--save_every", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=42)
    return parser


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class GQAttention(nn.Module):
    def __init__(self, d, nh, nkv, seq_len):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, nkv, d // nh
        self.q = nn.Linear(d, d, bias=False)
        self.kv = nn.Linear(d, 2 * nkv * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        f = torch.outer(torch.arange(seq_len).float(), inv)
        emb = torch.cat((f, f), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(B, T, 2, self.nkv, self.hd).permute(2, 0, 3, 1, 4)
        cos, sin = self.cos[:T], self.sin[:T]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.n1, self.n2 = RMSNorm(a.hidden), RMSNorm(a.hidden)
        self.attn = GQAttention(a.hidden, a.heads, a.kv_heads, a.seq_len)
        inner = 5632
        self.gate_up = nn.Linear(a.hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, a.hidden, bias=False)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        g, u = self.gate_up(self.n2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class CodeLM(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed = nn.Embedding(a.vocab, a.hidden)
        self.blocks = nn.ModuleList(Block(a) for _ in range(a.layers))
        self.norm = RMSNorm(a.hidden)
        self.head = nn.Linear(a.hidden, a.vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, tgt):
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), tgt.view(-1))


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    is_main = rank == 0

    train = np.memmap(args.train_bin, dtype=np.uint16, mode="r")
    val = np.memmap(args.val_bin, dtype=np.uint16, mode="r")
    rng = np.random.default_rng(args.seed + rank)

    def sample(data, r):
        T = args.seq_len
        starts = r.integers(0, len(data) - T - 1, size=args.micro_batch)
        buf = np.stack([data[s:s + T + 1] for s in starts]).astype(np.int64)
        buf = torch.from_numpy(buf).pin_memory().to(device, non_blocking=True)
        return buf[:, :-1], buf[:, 1:]

    torch.manual_seed(args.seed)
    model = CodeLM(args).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    model = torch.compile(model)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    def lr_at(step):
        if step < args.warmup_steps:
            return args.lr * step / args.warmup_steps
        p = min(1.0, (step - args.warmup_steps) / (args.total_steps - args.warmup_steps))
        return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * p))

    @torch.no_grad()
    def evaluate():
        model.eval()
        r = np.random.default_rng(1000 + rank)
        acc = torch.zeros((), device=device)
        for _ in range(args.eval_steps):
            x, y = sample(val, r)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                acc += model(x, y)
        dist.all_reduce(acc, op=dist.ReduceOp.SUM)
        model.train()
        return acc.item() / (args.eval_steps * world)

    writer = SummaryWriter(os.path.join(args.save_dir, "tb")) if is_main else None
    tokens_per_step = args.micro_batch * args.seq_len * args.grad_accum * world
    if is_main:
        print(f"{n_params/1e9:.2f}B params, world {world}, {tokens_per_step:,} tokens/step")

    t0 = time.time()
    for step in range(1, args.total_steps + 1):
        lr = lr_at(step)
        for g in opt.param_groups:
            g["lr"] = lr
        for micro in range(args.grad_accum):
            x, y = sample(train, rng)
            model.require_backward_grad_sync = micro == args.grad_accum - 1
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y) / args.grad_accum
            loss.backward()
        gnorm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

        if step % 10 == 0 and is_main:
            torch.cuda.synchronize()
            dt = (time.time() - t0) / 10
            t0 = time.time()
            tps = tokens_per_step / dt
            mfu = 6 * n_params * tps / (world * 989e12)
            writer.add_scalar("train/loss", loss.item() * args.grad_accum, step)
            writer.add_scalar("train/grad_norm", gnorm.item(), step)
            writer.add_scalar("perf/tokens_per_sec", tps, step)
            writer.add_scalar("perf/mfu", mfu, step)
            print(f"step {step} loss {loss.item() * args.grad_accum:.4f} lr {lr:.2e} {tps:,.0f} tok/s mfu {mfu:.1%}")

        if step % args.eval_every == 0:
            vl = evaluate()
            if is_main:
                writer.add_scalar("val/loss", vl, step)
                print(f"step {step} val_loss {vl:.4f}")

        if step % args.save_every == 0:
            if is_main:
                os.makedirs(args.save_dir, exist_ok=True)
                torch.save({"model": model.module._orig_mod.state_dict(), "opt": opt.state_dict(),
                            "step": step, "args": vars(args)}, os.path.join(args.save_dir, f"step_{step}.pt"))
            dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
