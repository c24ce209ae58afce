# Pretraining script for a GPT-2 medium sized model on FineWeb shards.
# Muon for 2D hidden weights, AdamW for the rest, bf16 autocast, torch.compile.
#
# usage:
#   torchrun --nnodes=1 --nproc_per_node=8 train_gpt_medium.py --config configs/gpt2_medium.yaml
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
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP

DEFAULTS = dict(
    train_bin="data/fineweb10B/fineweb_train_*.bin",
    val_bin="data/fineweb10B/fineweb_val_*.bin",
    out_dir="out/gpt2-medium",
    n_layer=24, n_head=16, n_embd=1024, block_size=1024, vocab_size=50304,
    micro_batch_size=16, total_batch_size=524288,
    max_steps=10000, warmup_steps=200, cooldown_steps=2000,
    adam_lr=3e-3, muon_lr=0.02, weight_decay=0.0,
    val_every=250, val_tokens=10485760, ckpt_every=2500,
)


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


class SelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        nn.init.zeros_(self.c_proj.weight)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(norm(q), norm(k), v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.attn = SelfAttention(n_embd, n_head)
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=False)
        nn.init.zeros_(self.proj.weight)

    def forward(self, x):
        x = x + self.attn(norm(x))
        return x + self.proj(F.relu(self.fc(norm(x))).square())


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg["vocab_size"], cfg["n_embd"])
        self.wpe = nn.Embedding(cfg["block_size"], cfg["n_embd"])
        self.blocks = nn.ModuleList([Block(cfg["n_embd"], cfg["n_head"]) for _ in range(cfg["n_layer"])])
        self.lm_head = nn.Linear(cfg["n_embd"], cfg["vocab_size"], bias=False)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.01)
        nn.init.zeros_(self.lm_head.weight)

    def forward(self, idx, targets):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@torch.compile
def zeropower(G, steps=5):
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    flip = G.size(0) > G.size(1)
    if flip:
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if flip else X


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                buf = st.get("momentum_buffer")
                if buf is None:
                    buf = st["momentum_buffer"] = torch.zeros_like(p.grad)
                buf.lerp_(p.grad, 1 - group["momentum"])
                g = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                p.add_(zeropower(g).type_as(p), alpha=-group["lr"] * max(1, p.size(0) / p.size(1)) ** 0.5)


def load_shard(path):
    header = np.fromfile(path, dtype=np.int32, count=256)
    assert header[0] == 20240520, "magic number mismatch"
    return np.memmap(path, dtype=np.uint16, mode="r", offset=256 * 4, shape=(int(header[2]),))


class DistributedTokenLoader:
    def __init__(self, pattern, B, T, rank, world_size):
        self.files = sorted(glob.glob(pattern))
        assert self.files, f"no files for {pattern}"
        self.B, self.T, self.rank, self.world_size = B, T, rank, world_size
        self.reset()

    def reset(self):
        self.shard = 0
        self.tokens = load_shard(self.files[0])
        self.pos = 0

    def next_batch(self, device):
        n = self.B * self.T
        if self.pos + n * self.world_size + 1 > len(self.tokens):
            self.shard = (self.shard + 1) % len(self.files)
            self.tokens = load_shard(self.files[self.shard])
            self.pos = 0
        s = self.pos + self.rank * n
        buf = torch.from_numpy(self.tokens[s: s + n + 1].astype(np.int64)).pin_memory()
        self.pos += n * self.world_size
        buf = buf.to(device, non_blocking=True)
        return buf[:-1].view(self.B, self.T), buf[1:].view(self.B, self.T)


def get_config():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=str, default=None)
    parser.add_argument("--local_rank", type=int, default=0)
    for k, v in DEFAULTS.items():
        parser.add_argument(f"--{k}", type=type(v), default=None)
    args = parser.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    for k in DEFAULTS:
        if getattr(args, k) is not None:
            cfg[k] = getattr(args, k)
    return cfg, args.local_rank


def main():
    cfg, local_rank = get_config()
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    master = rank == 0

    B, T = cfg["micro_batch_size"], cfg["block_size"]
    assert cfg["total_batch_size"] % (B * T * world_size) == 0
    accum = cfg["total_batch_size"] // (B * T * world_size)
    val_steps = cfg["val_tokens"] // (B * T * world_size)

    torch.manual_seed(1337)
    model = GPT(cfg).to(device)
    hidden = [p for p in model.blocks.parameters() if p.ndim == 2]
    rest = [model.wte.weight, model.wpe.weight, model.lm_head.weight]
    adamw = torch.optim.AdamW(rest, lr=cfg["adam_lr"], betas=(0.9, 0.95), weight_decay=cfg["weight_decay"], fused=True)
    muon = Muon(hidden, lr=cfg["muon_lr"])
    opts = [adamw, muon]
    init_lrs = [[g["lr"] for g in o.param_groups] for o in opts]

    model = torch.compile(model)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    train_loader = DistributedTokenLoader(cfg["train_bin"], B, T, rank, world_size)
    val_loader = DistributedTokenLoader(cfg["val_bin"], B, T, rank, world_size)

    def lr_mult(step):
        if step < cfg["warmup_steps"]:
            return (step + 1) / cfg["warmup_steps"]
        if step < cfg["max_steps"] - cfg["cooldown_steps"]:
            return 1.0
        return max(0.0, (cfg["max_steps"] - step) / cfg["cooldown_steps"])

    if master:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        print(f"world {world_size} | accum {accum} | val steps {val_steps}")

    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    for step in range(cfg["max_steps"] + 1):
        t0 = time.time()
        final = step == cfg["max_steps"]
        if step % cfg["val_every"] == 0 or final:
            model.eval()
            val_loader.reset()
            acc = torch.zeros((), device=device)
            with torch.no_grad(), autocast:
                for _ in range(val_steps):
                    acc += model(*val_loader.next_batch(device))
            acc /= val_steps
            dist.all_reduce(acc, op=dist.ReduceOp.AVG)
            model.train()
            if master:
                print(f"step {step} | val_loss {acc.item():.4f}")
        if master and step > 0 and (final or step % cfg["ckpt_every"] == 0):
            torch.save({"model": model.module._orig_mod.state_dict(), "step": step, "cfg": cfg},
                       os.path.join(cfg["out_dir"], f"ckpt_{step:06d}.pt"))
        if final:
            break

        mult = lr_mult(step)
        for o, lrs in zip(opts, init_lrs):
            for g, lr in zip(o.param_groups, lrs):
                g["lr"] = lr * mult
        train_loss = torch.zeros((), device=device)
        for micro in range(accum):
            x, y = train_loader.next_batch(device)
            model.require_backward_grad_sync = micro == accum - 1
            with autocast:
                loss = model(x, y) / accum
            loss.backward()
            train_loss += loss.detach()
        for o in opts:
            o.step()
        model.zero_grad(set_to_none=True)
        if step % 10 == 0:
            dist.all_reduce(train_loss, op=dist.ReduceOp.AVG)
            if master:
                print(f"step {step} | loss {train_loss.item():.4f} | lr x{mult:.3f} | {(time.time() - t0) * 1000:.0f}ms")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
