"""
Small GPT on pre-tokenized FineWeb shards.

Muon for the hidden weight matrices, AdamW for embeddings / head / gains.
The Newton-Schulz orthogonalisation is split across ranks: rank r handles
parameters r, r+W, r+2W, ... of every shape group, and the orthogonalised
updates are all-gathered so that every rank applies the same step.

    torchrun --standalone --nproc_per_node=8 01_muon_sharded_gpt.py \
        --data_dir /data/fineweb10B --out_dir runs/muon_gpt
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


# ----------------------------------------------------------------------------- optimizer

def zeropower_via_newtonschulz5(G, steps=5, eps=1e-7):
    """Quintic Newton-Schulz iteration, returns an approximately orthogonal matrix."""
    assert G.ndim == 2
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    X = X / (X.norm() + eps)
    transposed = G.size(0) > G.size(1)
    if transposed:
        X = X.T
    for _ in range(steps):
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    if transposed:
        X = X.T
    return X


class DistMuon(torch.optim.Optimizer):
    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0):
        params = list(params)
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        weight_decay=weight_decay)
        # one group per shape so the gathered updates all have the same size
        shapes = sorted({tuple(p.shape) for p in params})
        groups = [{"params": [p for p in params if tuple(p.shape) == s]} for s in shapes]
        super().__init__(groups, defaults)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            params = group["params"]
            lr, wd = group["lr"], group["weight_decay"]
            for base in range(0, len(params), self.world_size):
                idx = base + self.rank
                if idx < len(params):
                    p = params[idx]
                    g = p.grad
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(g)
                    buf = state["momentum_buffer"]
                    buf.lerp_(g, 1 - group["momentum"])
                    g = g.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                    u = zeropower_via_newtonschulz5(g, steps=group["ns_steps"])
                    u = u * max(1.0, p.size(0) / p.size(1)) ** 0.5
                    gathered = [torch.empty_like(u) for _ in range(self.world_size)]
                    dist.all_gather(gathered, u.contiguous())
                    for j, upd in enumerate(gathered):
                        if base + j < len(params):
                            q = params[base + j]
                            if wd > 0:
                                q.mul_(1 - lr * wd)
                            q.add_(upd.to(q.dtype), alpha=-lr)


# ----------------------------------------------------------------------------- model

class CausalSelfAttention(nn.Module):
    def __init__(self, dim, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(dim, 3 * dim, bias=False)
        self.c_proj = nn.Linear(dim, dim, bias=False)
        self.c_proj.weight.data.zero_()

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, dim, n_head):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, n_head)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim, bias=False)
        self.proj = nn.Linear(4 * dim, dim, bias=False)
        self.proj.weight.data.zero_()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab_size, seq_len, n_layer, n_head, dim):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, dim)
        self.wpe = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList([Block(dim, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# ----------------------------------------------------------------------------- data

def load_shard(path):
    header = np.fromfile(path, dtype=np.int32, count=256)
    assert header[0] == 20240520, "bad magic number"
    ntok = int(header[2])
    return np.memmap(path, dtype=np.uint16, mode="r", offset=256 * 4, shape=(ntok,))


class ShardedLoader:
    """Each rank reads its own contiguous window of B*T tokens at every step."""

    def __init__(self, pattern, B, T, rank, world_size):
        self.files = sorted(glob.glob(pattern))
        assert self.files, f"no files match {pattern}"
        self.B, self.T, self.rank, self.world_size = B, T, rank, world_size
        self.reset()

    def reset(self):
        self.file_idx = 0
        self.tokens = load_shard(self.files[0])
        self.pos = self.rank * self.B * self.T

    def next_batch(self):
        B, T = self.B, self.T
        if self.pos + B * T * self.world_size + 1 > len(self.tokens):
            self.file_idx = (self.file_idx + 1) % len(self.files)
            self.tokens = load_shard(self.files[self.file_idx])
            self.pos = self.rank * B * T
        buf = torch.from_numpy(self.tokens[self.pos:self.pos + B * T + 1].astype(np.int64))
        self.pos += B * T * self.world_size
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        return x.cuda(non_blocking=True), y.cuda(non_blocking=True)


# ----------------------------------------------------------------------------- main

def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="data/fineweb10B")
    p.add_argument("--out_dir", default="runs/muon_gpt")
    p.add_argument("--n_layer", type=int, default=12)
    p.add_argument("--n_head", type=int, default=6)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--vocab_size", type=int, default=50304)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=16, help="sequences per GPU")
    p.add_argument("--iters", type=int, default=5000)
    p.add_argument("--warmdown", type=int, default=1500)
    p.add_argument("--muon_lr", type=float, default=0.02)
    p.add_argument("--adam_lr", type=float, default=0.006)
    p.add_argument("--val_every", type=int, default=250)
    p.add_argument("--val_steps", type=int, default=20)
    p.add_argument("--save_every", type=int, default=1000)
    return p.parse_args()


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    master = rank == 0
    torch.manual_seed(1337)

    model = GPT(args.vocab_size, args.seq_len, args.n_layer, args.n_head, args.dim).cuda()
    model = DDP(model, device_ids=[local_rank])
    raw = model.module

    hidden = [p for p in raw.blocks.parameters() if p.ndim == 2]
    other = [p for n, p in raw.named_parameters() if not (n.startswith("blocks.") and p.ndim == 2)]
    adam = torch.optim.AdamW(other, lr=args.adam_lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    muon = DistMuon(hidden, lr=args.muon_lr, momentum=0.95)
    optimizers = [adam, muon]
    for opt in optimizers:
        for g in opt.param_groups:
            g["initial_lr"] = g["lr"]

    def lr_mult(it):
        if it < args.iters - args.warmdown:
            return 1.0
        return max(0.0, (args.iters - it) / args.warmdown)

    train_loader = ShardedLoader(os.path.join(args.data_dir, "fineweb_train_*.bin"),
                                 args.batch_size, args.seq_len, rank, world_size)
    val_loader = ShardedLoader(os.path.join(args.data_dir, "fineweb_val_*.bin"),
                               args.batch_size, args.seq_len, rank, world_size)
    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        n_params = sum(p.numel() for p in raw.parameters())
        print(f"params: {n_params / 1e6:.1f}M | world size {world_size}")

    t0 = time.time()
    for it in range(args.iters + 1):
        last = it == args.iters
        if it % args.val_every == 0 or last:
            model.eval()
            val_loader.reset()
            val_loss = torch.zeros((), device="cuda")
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                for _ in range(args.val_steps):
                    x, y = val_loader.next_batch()
                    val_loss += model(x, y)
            val_loss /= args.val_steps
            dist.all_reduce(val_loss, op=dist.ReduceOp.AVG)
            if master:
                print(f"it {it} val_loss {val_loss.item():.4f} elapsed {time.time() - t0:.0f}s")
            model.train()
        if (it > 0 and it % args.save_every == 0) or last:
            if master:
                torch.save({"model": raw.state_dict(), "iter": it, "args": vars(args)},
                           os.path.join(args.out_dir, f"ckpt_{it:06d}.pt"))
            dist.barrier()
        if last:
            break

        x, y = train_loader.next_batch()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()

        mult = lr_mult(it)
        for opt in optimizers:
            for g in opt.param_groups:
                g["lr"] = g["initial_lr"] * mult
        # momentum warmup for muon
        frac = min(it / 300, 1)
        for g in muon.param_groups:
            g["momentum"] = (1 - frac) * 0.85 + frac * 0.95
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)

        if master and it % 10 == 0:
            print(f"it {it} loss {loss.item():.4f} lr_mult {mult:.3f}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
