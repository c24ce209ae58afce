"""
Pretraining on a mixture of sources (fineweb-edu, stack-python, wikipedia) that were
tokenized into separate uint16 shard files. Shards are named <source>_<idx>.bin.

    torchrun --standalone --nproc_per_node=8 train_mix.py --data_dir /data/mix-gpt2 --run_name mix-d12
"""
import argparse
import glob
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


class Attention(nn.Module):
    def __init__(self, dim, n_head, max_len=4096):
        super().__init__()
        self.n_head = n_head
        self.c_q = nn.Linear(dim, dim, bias=False)
        self.c_kv = nn.Linear(dim, 2 * dim, bias=False)
        self.c_proj = nn.Linear(dim, dim, bias=False)
        hd = dim // n_head
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(max_len).float(), inv)
        self.register_buffer("cos", ang.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", ang.sin()[None, :, None, :], persistent=False)

    def rope(self, x):
        T = x.size(1)
        x1, x2 = x.float().chunk(2, dim=-1)
        c, s = self.cos[:, :T], self.sin[:, :T]
        return torch.cat([x1 * c + x2 * s, x2 * c - x1 * s], dim=-1).type_as(x)

    def forward(self, x):
        B, T, C = x.shape
        q = self.c_q(x).view(B, T, self.n_head, -1)
        k, v = self.c_kv(x).view(B, T, 2, self.n_head, -1).unbind(2)
        q, k = self.rope(norm(q)), self.rope(norm(k))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, dim, n_head):
        super().__init__()
        self.attn = Attention(dim, n_head)
        self.c_fc = nn.Linear(dim, 4 * dim, bias=False)
        self.c_out = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        x = x + self.attn(norm(x))
        return x + self.c_out(F.relu(self.c_fc(norm(x))).square())


class GPT(nn.Module):
    def __init__(self, vocab_size, dim, n_layer, n_head):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList([Block(dim, n_head) for _ in range(n_layer)])
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        for n, p in self.named_parameters():
            if n.endswith(("c_proj.weight", "c_out.weight")) or n == "lm_head.weight":
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        x = norm(self.wte(idx))
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@torch.compile
def newton_schulz5(G, steps=5):
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    wide = G.size(0) <= G.size(1)
    X = X if wide else X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X if wide else X.T


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr=0.02, momentum=0.95, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = st["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                g = p.grad.lerp(buf, group["momentum"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(newton_schulz5(g).type_as(p), alpha=-group["lr"] * max(1, p.size(0) / p.size(1)) ** 0.5)


def open_shard(path):
    header = np.fromfile(path, dtype=np.int32, count=256)
    assert header[0] == 20240520, path
    return np.memmap(path, dtype=np.uint16, mode="r", offset=1024, shape=(int(header[2]),))


class ShardStream:
    """Reads this rank's shard files front to back, cycling forever."""

    def __init__(self, files, B, T):
        assert len(files) > 0
        self.files, self.B, self.T = files, B, T
        self.fi, self.pos = 0, 0
        self.tokens = open_shard(self.files[0])

    def next_batch(self):
        n = self.B * self.T
        if self.pos + n + 1 > len(self.tokens):
            self.fi = (self.fi + 1) % len(self.files)
            self.tokens, self.pos = open_shard(self.files[self.fi]), 0
        buf = torch.from_numpy(self.tokens[self.pos: self.pos + n + 1].astype(np.int64)).pin_memory()
        self.pos += n
        buf = buf.cuda(non_blocking=True)
        return buf[:-1].view(self.B, self.T), buf[1:].view(self.B, self.T)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", default="/data/mix-gpt2")
    ap.add_argument("--run_name", default="mix-d12")
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--n_layer", type=int, default=12)
    ap.add_argument("--n_head", type=int, default=6)
    ap.add_argument("--B", type=int, default=32)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--cooldown", type=int, default=2400)
    ap.add_argument("--adam_lr", type=float, default=0.004)
    ap.add_argument("--muon_lr", type=float, default=0.025)
    ap.add_argument("--val_every", type=int, default=250)
    ap.add_argument("--val_tokens", type=int, default=10 * 2**20)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    master = rank == 0

    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    # shards are grouped by source in sorted order; shuffle so every rank gets a mix
    train_files = sorted(glob.glob(os.path.join(args.data_dir, "train", "*.bin")))
    random.shuffle(train_files)
    train_stream = ShardStream(train_files[rank::world_size], args.B, args.T)
    val_tokens = open_shard(sorted(glob.glob(os.path.join(args.data_dir, "val", "*.bin")))[0])

    model = GPT(50304, args.dim, args.n_layer, args.n_head).cuda()
    hidden = [p for p in model.blocks.parameters() if p.ndim == 2]
    adam = torch.optim.AdamW([model.wte.weight, model.lm_head.weight], lr=args.adam_lr,
                             betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    muon = Muon(hidden, lr=args.muon_lr, weight_decay=0.01)
    optimizers = [adam, muon]
    for o in optimizers:
        for g in o.param_groups:
            g["initial_lr"] = g["lr"]
    model = DDP(torch.compile(model), device_ids=[local_rank])

    def mult(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        return min(1.0, (args.steps - step) / args.cooldown)

    def validate():
        model.eval()
        n = args.B * args.T
        steps = args.val_tokens // (n * world_size)
        acc = torch.zeros((), device="cuda")
        with torch.no_grad():
            for i in range(steps):
                off = (i * world_size + rank) * n
                buf = torch.from_numpy(val_tokens[off: off + n + 1].astype(np.int64)).cuda()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    acc += model(buf[:-1].view(args.B, args.T), buf[1:].view(args.B, args.T))
        acc /= steps
        dist.all_reduce(acc, op=dist.ReduceOp.AVG)
        model.train()
        return acc.item()

    run_dir = os.path.join("runs", args.run_name)
    if master:
        os.makedirs(run_dir, exist_ok=True)
        print(f"{len(train_files)} train shards, {len(train_files[rank::world_size])} on rank 0")

    t_start = time.time()
    for step in range(args.steps + 1):
        if step % args.val_every == 0 or step == args.steps:
            vl = validate()
            if master:
                print(f"step {step} | val_loss {vl:.4f} | {(time.time() - t_start) / 60:.1f} min")
                with open(os.path.join(run_dir, "val.tsv"), "a") as f:
                    f.write(f"{step}\t{vl:.5f}\n")
        if step == args.steps:
            break
        x, y = train_stream.next_batch()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        m = mult(step)
        for o in optimizers:
            for g in o.param_groups:
                g["lr"] = g["initial_lr"] * m
            o.step()
        model.zero_grad(set_to_none=True)
        if step % 20 == 0:
            lt = loss.detach()
            dist.all_reduce(lt, op=dist.ReduceOp.AVG)
            if master:
                print(f"step {step} | loss {lt.item():.4f} | lr x{m:.3f}")

    if master:
        torch.save({"model": model.module._orig_mod.state_dict(), "args": vars(args)},
                   os.path.join(run_dir, "final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
