import os
import sys
import time
import glob
import argparse
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.nn.parallel import DistributedDataParallel as DDP

# torchrun --standalone --nproc_per_node=8 train_gpt.py --run_name d16_swa --save_every 1000

# -----------------------------------------------------------------------------
# Model: rotary, QK-norm, ReLU^2 MLP, document-causal sliding-window attention


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


class CastedLinear(nn.Linear):
    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x):
        return F.linear(x, self.weight.type_as(x))


class Rotary(nn.Module):
    def __init__(self, dim, max_seq_len=65536):
        super().__init__()
        inv_freq = (1 / 10000) ** torch.linspace(0, 1, steps=dim // 2, dtype=torch.float32)
        theta = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", theta.cos(), persistent=False)
        self.register_buffer("sin", theta.sin(), persistent=False)

    def forward(self, x):
        T = x.size(-3)
        cos, sin = self.cos[None, :T, None, :], self.sin[None, :T, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, -x1 * sin + x2 * cos), dim=-1).type_as(x)


class Block(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = CastedLinear(dim, 3 * dim)
        self.o = CastedLinear(dim, dim)
        self.fc = CastedLinear(dim, 4 * dim)
        self.proj = CastedLinear(4 * dim, dim)
        self.rotary = Rotary(dim // num_heads)
        self.o.weight.detach().zero_()
        self.proj.weight.detach().zero_()

    def forward(self, x, block_mask):
        B, T, C = x.shape
        q, k, v = self.qkv(norm(x)).view(B, T, 3 * self.num_heads, C // self.num_heads).chunk(3, dim=-2)
        q, k = self.rotary(norm(q)), self.rotary(norm(k))
        y = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, C))
        x = x + self.proj(F.relu(self.fc(norm(x))).square())
        return x


class GPT(nn.Module):
    def __init__(self, vocab_size, num_layers, num_heads, dim):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList([Block(dim, num_heads) for _ in range(num_layers)])
        self.lm_head = CastedLinear(dim, vocab_size)
        self.lm_head.weight.detach().zero_()

    def forward(self, inputs, targets, window):
        docs = (inputs == 50256).cumsum(0)

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (docs[q_idx] == docs[kv_idx]) & (q_idx - kv_idx < window)

        S = inputs.numel()
        block_mask = create_block_mask(mask_mod, None, None, S, S, device=inputs.device)
        x = norm(self.embed(inputs)[None])
        for block in self.blocks:
            x = block(x, block_mask)
        logits = self.lm_head(norm(x)).float()
        logits = 15 * torch.tanh(logits / 15)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets)

# -----------------------------------------------------------------------------
# Muon


@torch.compile
def zeropower_via_newtonschulz5(G, steps=5):
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    if G.size(0) > G.size(1):
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    if G.size(0) > G.size(1):
        X = X.T
    return X


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr=0.05, momentum=0.95):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                buf = state["momentum_buffer"]
                buf.lerp_(g, 1 - group["momentum"])
                g = g.lerp(buf, group["momentum"])
                p.add_(zeropower_via_newtonschulz5(g).type_as(p), alpha=-group["lr"] * max(1, p.size(0) / p.size(1)) ** 0.5)

# -----------------------------------------------------------------------------
# Data


def _load_data_shard(path):
    header = np.fromfile(path, dtype=np.int32, count=256)
    assert header[0] == 20240520 and header[1] == 1
    return np.memmap(path, dtype=np.uint16, mode="r", offset=1024, shape=(int(header[2]),))


def data_generator(pattern, seq_len_per_rank, rank, world_size):
    files = sorted(glob.glob(pattern))
    global_len = seq_len_per_rank * world_size
    fi, tokens, pos = 0, _load_data_shard(files[0]), 0
    while True:
        if pos + global_len + 1 > len(tokens):
            fi = (fi + 1) % len(files)
            tokens, pos = _load_data_shard(files[fi]), 0
        start = pos + rank * seq_len_per_rank
        buf = torch.from_numpy(tokens[start: start + seq_len_per_rank + 1].astype(np.int64)).pin_memory()
        pos += global_len
        yield buf[:-1].to("cuda", dtype=torch.int32, non_blocking=True), buf[1:].to("cuda", non_blocking=True)

# -----------------------------------------------------------------------------


@dataclass
class Hyperparameters:
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"
    run_name: str = "d16_swa"
    num_layers: int = 16
    num_heads: int = 8
    model_dim: int = 1024
    seq_len: int = 64 * 1024
    window: int = 1024
    num_iterations: int = 6000
    cooldown_frac: float = 0.4
    val_tokens: int = 10485760
    val_loss_every: int = 250
    save_every: int = 1000


parser = argparse.ArgumentParser()
for name, field in Hyperparameters.__dataclass_fields__.items():
    parser.add_argument(f"--{name}", type=type(field.default), default=field.default)
args = Hyperparameters(**vars(parser.parse_args()))

rank = int(os.environ["RANK"])
world_size = int(os.environ["WORLD_SIZE"])
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group(backend="nccl")
master_process = rank == 0
run_dir = os.path.join("logs", args.run_name)
os.makedirs(run_dir, exist_ok=True)


def print0(s):
    if master_process:
        print(s)
        with open(os.path.join(run_dir, "log.txt"), "a") as f:
            print(s, file=f)


print0(" ".join(sys.argv))
print0(f"world_size={world_size} {args}")

model = GPT(50304, args.num_layers, args.num_heads, args.model_dim).cuda()
for m in model.modules():
    if isinstance(m, nn.Embedding):
        m.bfloat16()
model = DDP(torch.compile(model), device_ids=[local_rank])
raw_model = model.module._orig_mod

hidden = [p for p in raw_model.blocks.parameters() if p.ndim >= 2]
adam = torch.optim.Adam([dict(params=[raw_model.embed.weight], lr=0.6),
                         dict(params=[raw_model.lm_head.weight], lr=0.008)],
                        betas=(0.8, 0.95), eps=1e-10, fused=True)
muon = Muon(hidden, lr=0.05, momentum=0.95)
optimizers = [adam, muon]
for opt in optimizers:
    for g in opt.param_groups:
        g["initial_lr"] = g["lr"]


def get_lr(step):
    x = step / args.num_iterations
    return 1.0 if x < 1 - args.cooldown_frac else (1 - x) / args.cooldown_frac


train_loader = data_generator(args.train_files, args.seq_len, rank, world_size)
torch.cuda.synchronize()
t0 = time.perf_counter()
train_ms = 0.0
for step in range(args.num_iterations + 1):
    last_step = step == args.num_iterations
    if last_step or step % args.val_loss_every == 0:
        torch.cuda.synchronize()
        train_ms += 1000 * (time.perf_counter() - t0)
        model.eval()
        val_steps = args.val_tokens // (args.seq_len * world_size)
        val_loader = data_generator(args.val_files, args.seq_len, rank, world_size)
        val_loss = torch.zeros((), device="cuda")
        with torch.no_grad():
            for _ in range(val_steps):
                val_loss += model(*next(val_loader), args.window)
        val_loss /= val_steps
        dist.all_reduce(val_loss, op=dist.ReduceOp.AVG)
        print0(f"step:{step}/{args.num_iterations} val_loss:{val_loss.item():.4f} train_time:{train_ms:.0f}ms")
        model.train()
        torch.cuda.synchronize()
        t0 = time.perf_counter()

    if step > 0 and (last_step or step % args.save_every == 0):
        state = dict(step=step, model=raw_model.state_dict(),
                     optimizers=[o.state_dict() for o in optimizers], args=vars(args))
        torch.save(state, os.path.join(run_dir, f"state_step{step:06d}.pt"))
        print0(f"saved checkpoint at step {step}")

    if last_step:
        break

    inputs, targets = next(train_loader)
    model(inputs, targets, args.window).backward()
    for opt in optimizers:
        for g in opt.param_groups:
            g["lr"] = g["initial_lr"] * get_lr(step)
    for g in muon.param_groups:
        g["momentum"] = 0.85 + 0.10 * min(step / 300, 1)
    for opt in optimizers:
        opt.step()
    model.zero_grad(set_to_none=True)

print0(f"peak memory {torch.cuda.max_memory_allocated() // 2**20} MiB")
dist.destroy_process_group()
