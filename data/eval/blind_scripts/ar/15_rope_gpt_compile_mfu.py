"""
RoPE / SwiGLU decoder pretraining with torch.compile + DDP, MFU logging.

    torchrun --standalone --nproc_per_node=8 15_rope_gpt_compile_mfu.py --data_dir data/fineweb10B \
        --compile --out_dir out/rope-d24
"""
import argparse
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class ModelArgs:
    vocab_size: int = 50304
    dim: int = 1024
    n_layers: int = 24
    n_heads: int = 16
    max_seq_len: int = 1024
    ffn_mult: float = 8 / 3


def rope_cache(seq_len, head_dim, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    t = torch.arange(seq_len).float()
    freqs = torch.outer(t, inv)
    return torch.cos(freqs), torch.sin(freqs)


def apply_rope(x, cos, sin):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.nh, self.hd = a.n_heads, a.dim // a.n_heads
        self.wqkv = nn.Linear(a.dim, 3 * a.dim, bias=False)
        self.wo = nn.Linear(a.dim, a.dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q, k, v = self.wqkv(x).view(B, T, 3, self.nh, self.hd).unbind(2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        hidden = int(a.ffn_mult * a.dim)
        hidden = 256 * ((hidden + 255) // 256)
        self.w1 = nn.Linear(a.dim, hidden, bias=False)
        self.w3 = nn.Linear(a.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, a.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.n1, self.attn = nn.RMSNorm(a.dim), Attention(a)
        self.n2, self.ffn = nn.RMSNorm(a.dim), SwiGLU(a)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.n1(x), cos, sin)
        return x + self.ffn(self.n2(x))


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.tok = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList([Layer(a) for _ in range(a.n_layers)])
        self.norm = nn.RMSNorm(a.dim)
        self.head = nn.Linear(a.dim, a.vocab_size, bias=False)
        cos, sin = rope_cache(a.max_seq_len, a.dim // a.n_heads)
        self.register_buffer("cos", cos[None, :, None, :], persistent=False)
        self.register_buffer("sin", sin[None, :, None, :], persistent=False)
        for n, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * a.n_layers) if n.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx, targets):
        T = idx.size(1)
        cos, sin = self.cos[:, :T], self.sin[:, :T]
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def estimate_mfu(self, tokens_per_iter, dt, peak_flops=989e12):
        a = self.args
        n = sum(p.numel() for p in self.parameters()) - self.tok.weight.numel()
        flops_per_token = 6 * n + 12 * a.n_layers * a.dim * a.max_seq_len
        return flops_per_token * tokens_per_iter / dt / peak_flops


class RandomWindows:
    def __init__(self, path, batch, seq_len, seed):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.batch, self.seq_len = batch, seq_len
        self.g = torch.Generator().manual_seed(seed)

    def next(self, device):
        ix = torch.randint(len(self.data) - self.seq_len - 1, (self.batch,), generator=self.g).tolist()
        buf = torch.from_numpy(np.stack([self.data[i:i + self.seq_len + 1] for i in ix]).astype(np.int64))
        buf = buf.pin_memory().to(device, non_blocking=True)
        return buf[:, :-1], buf[:, 1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--out_dir", default="out/rope")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--total_batch_tokens", type=int, default=524288)
    ap.add_argument("--max_steps", type=int, default=19000)
    ap.add_argument("--warmup", type=int, default=700)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--val_every", type=int, default=250)
    ap.add_argument("--val_steps", type=int, default=20)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = f"cuda:{local_rank}"
    torch.cuda.set_device(device)
    master = rank == 0
    torch.manual_seed(42)
    torch.set_float32_matmul_precision("high")

    margs = ModelArgs()
    accum = args.total_batch_tokens // (args.batch * margs.max_seq_len * world)
    assert accum >= 1 and args.total_batch_tokens % (args.batch * margs.max_seq_len * world) == 0
    train = RandomWindows(os.path.join(args.data_dir, "train.bin"), args.batch, margs.max_seq_len, seed=rank)
    val = RandomWindows(os.path.join(args.data_dir, "val.bin"), args.batch, margs.max_seq_len, seed=10_000 + rank)

    model = Transformer(margs).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    nodecay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=True)
    if args.compile:
        model = torch.compile(model)
    model = DDP(model, device_ids=[local_rank])

    def lr_at(s):
        if s < args.warmup:
            return args.lr * (s + 1) / args.warmup
        return args.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - args.warmup) / (args.max_steps - args.warmup))))

    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"world {world}, grad accum {accum}, {args.total_batch_tokens:,} tokens/step")

    t0 = time.time()
    for step in range(args.max_steps + 1):
        last = step == args.max_steps
        if step % args.val_every == 0 or last:
            model.eval()
            vloss = torch.zeros((), device=device)
            with torch.no_grad():
                for _ in range(args.val_steps):
                    x, y = val.next(device)
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        vloss += model(x, y) / args.val_steps
            dist.all_reduce(vloss, op=dist.ReduceOp.AVG)
            model.train()
            if master:
                print(f"step {step} val_loss {vloss.item():.4f}", flush=True)
                sd = model.module.state_dict()
                sd = {k.removeprefix("_orig_mod."): v for k, v in sd.items()}
                torch.save({"model": sd, "opt": opt.state_dict(), "step": step, "args": vars(args)},
                           os.path.join(args.out_dir, "latest.pt"))
            t0 = time.time()
        if last:
            break

        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss_accum = torch.zeros((), device=device)
        for micro in range(accum):
            x, y = train.next(device)
            model.require_backward_grad_sync = micro == accum - 1
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y) / accum
            loss_accum += loss.detach()
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

        if step % 10 == 0:
            dist.all_reduce(loss_accum, op=dist.ReduceOp.AVG)
            torch.cuda.synchronize()
            dt = time.time() - t0
            if master and step > 0:
                mfu = model.estimate_mfu(args.total_batch_tokens * 10 // world, dt)
                print(f"step {step} loss {loss_accum.item():.4f} norm {norm:.3f} lr {lr_at(step):.2e} "
                      f"{dt * 100:.0f}ms/step {args.total_batch_tokens * 10 / dt:,.0f} tok/s mfu {mfu:.1%}",
                      flush=True)
            t0 = time.time()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
