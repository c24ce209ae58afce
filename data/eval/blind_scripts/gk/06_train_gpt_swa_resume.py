"""
GPT with sliding-window attention (FlexAttention) trained on FineWeb-Edu shards.
Supports resuming from the latest checkpoint in --out_dir.

torchrun --standalone --nproc_per_node=8 train_gpt_swa.py --out_dir runs/swa-d12 --resume
"""
import argparse
import glob
import math
import os
import re
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--train_pattern", default="data/edu_fineweb10B/edufineweb_train_*.bin")
parser.add_argument("--val_pattern", default="data/edu_fineweb10B/edufineweb_val_*.bin")
parser.add_argument("--out_dir", default="runs/swa-d12")
parser.add_argument("--depth", type=int, default=12)
parser.add_argument("--B", type=int, default=32)
parser.add_argument("--T", type=int, default=2048)
parser.add_argument("--window", type=int, default=512)
parser.add_argument("--total_batch_size", type=int, default=524288)
parser.add_argument("--max_steps", type=int, default=19073)
parser.add_argument("--warmup_steps", type=int, default=715)
parser.add_argument("--adam_lr", type=float, default=6e-4)
parser.add_argument("--muon_lr", type=float, default=0.02)
parser.add_argument("--val_every", type=int, default=250)
parser.add_argument("--val_tokens", type=int, default=20 * 524288)
parser.add_argument("--save_every", type=int, default=2000)
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        nn.init.zeros_(self.proj.weight)

    def forward(self, x, block_mask):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        y = flex_attention(q, k, v, block_mask=block_mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, dim, n_head):
        super().__init__()
        self.attn = CausalSelfAttention(dim, n_head)
        self.fc = nn.Linear(dim, 4 * dim, bias=False)
        self.out = nn.Linear(4 * dim, dim, bias=False)
        nn.init.zeros_(self.out.weight)

    def forward(self, x, block_mask):
        x = x + self.attn(F.rms_norm(x, (x.size(-1),)), block_mask)
        h = F.rms_norm(x, (x.size(-1),))
        return x + self.out(F.relu(self.fc(h)).square())


class GPT(nn.Module):
    def __init__(self, vocab_size, depth, seq_len, window):
        super().__init__()
        dim = depth * 64
        self.wte = nn.Embedding(vocab_size, dim)
        self.wpe = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList([Block(dim, dim // 128) for _ in range(depth)])
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        nn.init.zeros_(self.lm_head.weight)
        self.window = window

    def forward(self, idx, targets):
        B, T = idx.shape
        window = self.window

        def sliding_causal(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

        block_mask = create_block_mask(sliding_causal, None, None, T, T, device=idx.device)
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x, block_mask)
        logits = self.lm_head(F.rms_norm(x, (x.size(-1),))).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@torch.compile
def newton_schulz(G, steps=5):
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    transposed = X.size(0) > X.size(1)
    if transposed:
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if transposed else X


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr=0.02, momentum=0.95):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                g = p.grad.lerp(buf, group["momentum"])
                update = newton_schulz(g)
                p.add_(update.type_as(p), alpha=-group["lr"] * max(1, p.size(0) / p.size(1)) ** 0.5)


def load_tokens(filename):
    header = np.fromfile(filename, dtype=np.int32, count=256)
    assert header[0] == 20240520
    return np.memmap(filename, dtype=np.uint16, mode="r", offset=1024, shape=(int(header[2]),))


class DataLoaderLite:
    def __init__(self, B, T, rank, world_size, pattern):
        self.B, self.T = B, T
        self.rank, self.world_size = rank, world_size
        self.shards = sorted(glob.glob(pattern))
        assert len(self.shards) > 0, f"no shards found for {pattern}"
        self.reset()

    def reset(self, shard=0, pos=0):
        self.current_shard = shard
        self.tokens = load_tokens(self.shards[self.current_shard])
        self.pos = pos  # start of the current global batch, identical on every rank

    def state(self):
        return {"shard": self.current_shard, "pos": self.pos}

    def load_state(self, st):
        self.reset(st["shard"], st["pos"])

    def next_batch(self):
        B, T = self.B, self.T
        start = self.pos + B * T * self.rank
        buf = torch.from_numpy(self.tokens[start: start + B * T + 1].astype(np.int64))
        x = buf[:-1].view(B, T)
        y = buf[1:].view(B, T)
        self.pos += B * T * self.world_size
        if self.pos + (B * T * self.world_size + 1) > len(self.tokens):
            self.current_shard = (self.current_shard + 1) % len(self.shards)
            self.tokens = load_tokens(self.shards[self.current_shard])
            self.pos = 0
        return x.cuda(non_blocking=True), y.cuda(non_blocking=True)


def latest_checkpoint(out_dir):
    ckpts = glob.glob(os.path.join(out_dir, "ckpt_*.pt"))
    if not ckpts:
        return None
    return max(ckpts, key=lambda p: int(re.findall(r"ckpt_(\d+)\.pt", p)[0]))


rank = int(os.environ["RANK"])
local_rank = int(os.environ["LOCAL_RANK"])
world_size = int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(local_rank)
device = torch.device("cuda", local_rank)
dist.init_process_group("nccl")
master = rank == 0
torch.manual_seed(1337)

grad_accum = args.total_batch_size // (args.B * args.T * world_size)
assert args.total_batch_size % (args.B * args.T * world_size) == 0
val_steps = args.val_tokens // (args.B * args.T * world_size)

train_loader = DataLoaderLite(args.B, args.T, rank, world_size, args.train_pattern)
val_loader = DataLoaderLite(args.B, args.T, rank, world_size, args.val_pattern)

model = GPT(50304, args.depth, args.T, args.window).to(device)
hidden = [p for p in model.blocks.parameters() if p.ndim == 2]
other = [model.wte.weight, model.wpe.weight, model.lm_head.weight]
adamw = torch.optim.AdamW(other, lr=args.adam_lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
muon = Muon(hidden, lr=args.muon_lr)
optimizers = [adamw, muon]

start_step = 0
if args.resume:
    path = latest_checkpoint(args.out_dir)
    if path is not None:
        ckpt = torch.load(path, map_location="cpu")
        state_dict = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}
        model.load_state_dict(state_dict)
        for opt, sd in zip(optimizers, ckpt["optimizers"]):
            opt.load_state_dict(sd)
        train_loader.load_state(ckpt["loader"])
        start_step = ckpt["step"] + 1
        if master:
            print(f"resumed from {path} at step {start_step}")
        del ckpt

model = torch.compile(model)
model = DDP(model, device_ids=[local_rank])
raw_model = model.module

for opt in optimizers:
    for g in opt.param_groups:
        g.setdefault("initial_lr", g["lr"])


def lr_mult(step):
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    ratio = (step - args.warmup_steps) / (args.max_steps - args.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * ratio))


if master:
    os.makedirs(args.out_dir, exist_ok=True)
    log_path = os.path.join(args.out_dir, "log.txt")

for step in range(start_step, args.max_steps):
    t0 = time.time()
    last_step = step == args.max_steps - 1

    if step % args.val_every == 0 or last_step:
        model.eval()
        val_loader.reset()
        val_loss = torch.zeros((), device=device)
        with torch.no_grad():
            for _ in range(val_steps):
                x, y = val_loader.next_batch()
                with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                    val_loss += model(x, y).detach()
        val_loss /= val_steps
        dist.all_reduce(val_loss, op=dist.ReduceOp.AVG)
        model.train()
        if master:
            print(f"step {step} | val loss {val_loss.item():.4f}")
            with open(log_path, "a") as f:
                f.write(f"{step} val {val_loss.item():.4f}\n")

    loss_accum = torch.zeros((), device=device)
    for micro_step in range(grad_accum):
        x, y = train_loader.next_batch()
        model.require_backward_grad_sync = micro_step == grad_accum - 1
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            loss = model(x, y) / grad_accum
        loss_accum += loss.detach()
        loss.backward()
    dist.all_reduce(loss_accum, op=dist.ReduceOp.AVG)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    m = lr_mult(step)
    for opt in optimizers:
        for g in opt.param_groups:
            g["lr"] = g["initial_lr"] * m
        opt.step()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    dt = time.time() - t0

    if master:
        tps = args.total_batch_size / dt
        print(f"step {step:5d} | loss {loss_accum.item():.6f} | lr x{m:.3f} | norm {norm:.4f} | "
              f"dt {dt * 1000:.1f}ms | tok/sec {tps:.0f}")
        with open(log_path, "a") as f:
            f.write(f"{step} train {loss_accum.item():.6f}\n")

    if step > 0 and (step % args.save_every == 0 or last_step):
        if master:
            ckpt = {
                "model": raw_model.state_dict(),
                "optimizers": [opt.state_dict() for opt in optimizers],
                "loader": train_loader.state(),
                "step": step,
                "args": vars(args),
            }
            torch.save(ckpt, os.path.join(args.out_dir, f"ckpt_{step}.pt"))
        dist.barrier()

dist.destroy_process_group()
