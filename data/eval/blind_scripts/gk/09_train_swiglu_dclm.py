"""
One-epoch pretraining over a directory of tokenized shards (uint16, llm.c header).
Each rank streams its own subset of shard files, so no token is seen twice.

    torchrun --nproc_per_node=8 train_epoch.py --data_dir /data/dclm-baseline-10B --out_dir runs/epoch1
"""
import argparse
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

HEADER_INTS = 256


def shard_num_tokens(path):
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    assert header[0] == 20240520, path
    return int(header[2])


def open_shard(path):
    return np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_INTS * 4, shape=(shard_num_tokens(path),))


class RankShardStream:
    """Iterates once over this rank's shard files, yielding (x, y) batches of B sequences of length T."""

    def __init__(self, files, B, T):
        self.files, self.B, self.T = files, B, T

    def __iter__(self):
        n = self.B * self.T
        for path in self.files:
            tokens = open_shard(path)
            for pos in range(0, len(tokens) - n - 1, n):
                buf = torch.from_numpy(tokens[pos: pos + n + 1].astype(np.int64)).pin_memory()
                x = buf[:-1].view(self.B, self.T).cuda(non_blocking=True)
                y = buf[1:].view(self.B, self.T).cuda(non_blocking=True)
                yield x, y


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, n_head, rope_theta=10000.0, max_len=4096):
        super().__init__()
        self.n_head = n_head
        self.hd = dim // n_head
        self.norm1 = nn.RMSNorm(dim)
        self.norm2 = nn.RMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.mlp = SwiGLU(dim, int(8 * dim / 3 / 64) * 64)
        freqs = 1.0 / (rope_theta ** (torch.arange(0, self.hd, 2).float() / self.hd))
        ang = torch.outer(torch.arange(max_len).float(), freqs)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def _rope(self, x):
        T = x.size(1)
        cos, sin = self.cos[None, :T, None, :], self.sin[None, :T, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.wqkv(self.norm1(x)).view(B, T, 3, self.n_head, self.hd).unbind(2)
        q, k = self._rope(q), self._rope(k)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.norm2(x))


class LM(nn.Module):
    def __init__(self, vocab_size, dim, n_layer, n_head):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList([Block(dim, n_head) for _ in range(n_layer)])
        self.norm = nn.RMSNorm(dim)
        self.out = nn.Linear(dim, vocab_size, bias=False)
        for n, p in self.named_parameters():
            if p.ndim == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer) if n.endswith(("wo.weight", "w2.weight")) else 0.02)

    def forward(self, idx, targets):
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.out(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@torch.compile
def orthogonalize(G, steps=5):
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    tall = X.size(0) > X.size(1)
    if tall:
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr=0.02, momentum=0.95, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, mom, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buf.lerp_(p.grad, 1 - mom)
                u = orthogonalize(p.grad.lerp(buf, mom))
                p.mul_(1 - lr * wd)
                p.add_(u.type_as(p), alpha=-lr * max(1, p.size(0) / p.size(1)) ** 0.5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--out_dir", default="runs/epoch1")
    ap.add_argument("--vocab_size", type=int, default=50304)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--n_layer", type=int, default=16)
    ap.add_argument("--n_head", type=int, default=16)
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--adam_lr", type=float, default=3e-3)
    ap.add_argument("--muon_lr", type=float, default=0.02)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--val_every", type=int, default=500)
    ap.add_argument("--val_tokens", type=int, default=8 * 2**20)
    args = ap.parse_args()

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    master = rank == 0
    torch.manual_seed(0)

    train_files = sorted(glob.glob(os.path.join(args.data_dir, "train_*.bin")))
    val_files = sorted(glob.glob(os.path.join(args.data_dir, "val_*.bin")))
    total_tokens = sum(shard_num_tokens(f) for f in train_files)
    tokens_per_step = args.B * args.T * world_size
    total_steps = total_tokens // tokens_per_step
    train_stream = RankShardStream(train_files[rank::world_size], args.B, args.T)

    model = LM(args.vocab_size, args.dim, args.n_layer, args.n_head).cuda()
    matrices = [p for p in model.layers.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if not any(p is m for m in matrices)]
    opt_adam = torch.optim.AdamW(rest, lr=args.adam_lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    opt_muon = Muon(matrices, lr=args.muon_lr, weight_decay=0.01)
    optimizers = [opt_adam, opt_muon]
    base = [g["lr"] for o in optimizers for g in o.param_groups]
    model = DDP(torch.compile(model), device_ids=[local_rank])

    def schedule(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        return max(0.0, 1 - (step - args.warmup) / max(1, total_steps - args.warmup))

    def evaluate():
        model.eval()
        n = args.B * args.T
        steps = args.val_tokens // (n * world_size)
        tokens = open_shard(val_files[0])
        tot = torch.zeros((), device="cuda")
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
            for i in range(steps):
                off = (i * world_size + rank) * n
                buf = torch.from_numpy(tokens[off: off + n + 1].astype(np.int64)).cuda()
                tot += model(buf[:-1].view(args.B, args.T), buf[1:].view(args.B, args.T))
        dist.all_reduce(tot, op=dist.ReduceOp.SUM)
        model.train()
        return tot.item() / (steps * world_size)

    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"{len(train_files)} train shards, {total_tokens / 1e9:.2f}B tokens, ~{total_steps} steps")

    t0 = time.time()
    step = 0
    for step, (x, y) in enumerate(train_stream):
        if step % args.val_every == 0:
            vl = evaluate()
            if master:
                print(f"step {step} | val {vl:.4f}")
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        mult = schedule(step)
        i = 0
        for o in optimizers:
            for g in o.param_groups:
                g["lr"] = base[i] * mult
                i += 1
            o.step()
        model.zero_grad(set_to_none=True)
        if step % 50 == 0:
            l = loss.detach().clone()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if master:
                dt = time.time() - t0
                t0 = time.time()
                print(f"step {step}/{total_steps} | loss {l.item():.4f} | lr x{mult:.3f} | {dt:.1f}s/50 steps")

    vl = evaluate()
    if master:
        print(f"final | step {step} | val {vl:.4f}")
        torch.save({"model": model.module._orig_mod.state_dict(), "step": step, "args": vars(args)},
                   os.path.join(args.out_dir, "final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
