"""
Small GPT speedrun variant: rotary + QK-norm + ReLU^2, Muon on hidden matrices,
Adam on embeddings/head, DDP over 8 GPUs.

torchrun --standalone --nproc_per_node=8 train_gpt.py --run_name rope_relu2
"""
import argparse
import glob
import itertools
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


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


class Rotary(nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.seq_len_cached = None
        self.cos_cached = None
        self.sin_cached = None

    def forward(self, x):
        seq_len = x.shape[1]
        if seq_len != self.seq_len_cached:
            self.seq_len_cached = seq_len
            t = torch.arange(seq_len, device=x.device).type_as(self.inv_freq)
            freqs = torch.outer(t, self.inv_freq).to(x.device)
            self.cos_cached = freqs.cos().bfloat16()
            self.sin_cached = freqs.sin().bfloat16()
        return self.cos_cached[None, :, None, :], self.sin_cached[None, :, None, :]


def apply_rotary_emb(x, cos, sin):
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    y1 = x1 * cos + x2 * sin
    y2 = x1 * (-sin) + x2 * cos
    return torch.cat([y1, y2], 3).type_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.head_dim = n_embd // n_head
        self.c_q = nn.Linear(n_embd, n_embd, bias=False)
        self.c_k = nn.Linear(n_embd, n_embd, bias=False)
        self.c_v = nn.Linear(n_embd, n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.c_proj.weight.data.zero_()
        self.rotary = Rotary(self.head_dim)

    def forward(self, x):
        B, T, C = x.size()
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_head, self.head_dim)
        cos, sin = self.rotary(q)
        q, k = norm(q), norm(k)
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        y = y.transpose(1, 2).contiguous().view_as(x)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=False)
        self.c_proj.weight.data.zero_()

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(norm(x))
        x = x + self.mlp(norm(x))
        return x


@dataclass
class GPTConfig:
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 6
    n_embd: int = 768


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.h = nn.ModuleList([Block(config.n_embd, config.n_head) for _ in range(config.n_layer)])
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight.data.zero_()

    def forward(self, idx, targets):
        x = norm(self.wte(idx))
        for block in self.h:
            x = block(x)
        x = norm(x)
        logits = self.lm_head(x).float()
        logits = 30 * torch.tanh(logits / 30)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@torch.compile
def zeropower_via_newtonschulz5(G, steps=5):
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    X /= X.norm() + 1e-7
    if G.size(0) > G.size(1):
        X = X.T
    for _ in range(steps):
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(0) > G.size(1):
        X = X.T
    return X


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                buf = state["momentum_buffer"]
                buf.lerp_(g, 1 - group["momentum"])
                g = g.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                g = zeropower_via_newtonschulz5(g, steps=group["ns_steps"])
                p.add_(g.type_as(p), alpha=-group["lr"] * max(1, p.size(0) / p.size(1)) ** 0.5)

# -----------------------------------------------------------------------------
# data loading


def _load_data_shard(filename):
    header = np.fromfile(filename, dtype=np.int32, count=256)
    assert header[0] == 20240520, "magic number mismatch in the data .bin file"
    ntok = int(header[2])
    return np.memmap(filename, dtype=np.uint16, mode="r", offset=256 * 4, shape=(ntok,))


def distributed_data_generator(filename_pattern, seq_len, local_batch_size, rank, world_size):
    files = sorted(glob.glob(filename_pattern))
    assert len(files) > 0, f"no files match {filename_pattern}"
    tokens_per_rank = local_batch_size * seq_len
    tokens_per_step = tokens_per_rank * world_size
    file_iter = itertools.cycle(files)
    tokens, pos = _load_data_shard(next(file_iter)), 0
    while True:
        if pos + tokens_per_step + 1 > len(tokens):
            tokens, pos = _load_data_shard(next(file_iter)), 0
        buf = torch.from_numpy(tokens[pos: pos + tokens_per_rank + 1].astype(np.int64))
        x = buf[:-1].view(local_batch_size, seq_len).cuda(non_blocking=True)
        y = buf[1:].view(local_batch_size, seq_len).cuda(non_blocking=True)
        pos += tokens_per_step
        yield x, y

# -----------------------------------------------------------------------------


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_files", default="data/fineweb10B/fineweb_train_*.bin")
    parser.add_argument("--val_files", default="data/fineweb10B/fineweb_val_*.bin")
    parser.add_argument("--device_batch_size", type=int, default=64)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--num_iterations", type=int, default=3200)
    parser.add_argument("--warmdown_iters", type=int, default=900)
    parser.add_argument("--embed_lr", type=float, default=0.6)
    parser.add_argument("--head_lr", type=float, default=0.008)
    parser.add_argument("--muon_lr", type=float, default=0.04)
    parser.add_argument("--val_loss_every", type=int, default=125)
    parser.add_argument("--val_tokens", type=int, default=10485760)
    parser.add_argument("--run_name", default="run")
    return parser.parse_args()


def main():
    args = parse_args()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    master_process = rank == 0
    torch.manual_seed(0)

    run_dir = os.path.join("logs", args.run_name)
    if master_process:
        os.makedirs(run_dir, exist_ok=True)
        logf = open(os.path.join(run_dir, "log.txt"), "w")

    def log0(msg):
        if master_process:
            print(msg)
            logf.write(msg + "\n")
            logf.flush()

    B, T = args.device_batch_size, args.seq_len
    val_steps = args.val_tokens // (B * T * world_size)
    train_loader = distributed_data_generator(args.train_files, T, B, rank, world_size)

    model = GPT(GPTConfig()).cuda()
    model = torch.compile(model)
    model = DDP(model, device_ids=[local_rank])
    raw_model = model.module._orig_mod

    optimizer1 = torch.optim.Adam([raw_model.wte.weight], lr=args.embed_lr, betas=(0.9, 0.95), fused=True)
    optimizer2 = torch.optim.Adam([raw_model.lm_head.weight], lr=args.head_lr, betas=(0.9, 0.95), fused=True)
    optimizer3 = Muon(raw_model.h.parameters(), lr=args.muon_lr, momentum=0.95)
    optimizers = [optimizer1, optimizer2, optimizer3]

    def get_lr(it):
        if it < args.num_iterations - args.warmdown_iters:
            return 1.0
        return (args.num_iterations - it) / args.warmdown_iters

    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, get_lr) for opt in optimizers]

    ctx = torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    training_time_ms = 0.0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for step in range(args.num_iterations + 1):
        last_step = step == args.num_iterations
        if step == 10:
            # don't count compilation in the timing
            training_time_ms = 0.0
            t0 = time.perf_counter()
        timed_steps = float("nan") if step <= 11 else step - 10 + 1

        if last_step or (args.val_loss_every > 0 and step % args.val_loss_every == 0):
            torch.cuda.synchronize()
            training_time_ms += 1000 * (time.perf_counter() - t0)
            model.eval()
            val_loader = distributed_data_generator(args.val_files, T, B, rank, world_size)
            val_loss = torch.zeros((), device="cuda")
            with torch.no_grad():
                for _ in range(val_steps):
                    x_val, y_val = next(val_loader)
                    with ctx:
                        val_loss += model(x_val, y_val)
            dist.all_reduce(val_loss, op=dist.ReduceOp.AVG)
            val_loss /= val_steps
            log0(f"step:{step}/{args.num_iterations} val_loss:{val_loss.item():.4f} "
                 f"train_time:{training_time_ms:.0f}ms step_avg:{training_time_ms / (timed_steps - 1):.2f}ms")
            model.train()
            torch.cuda.synchronize()
            t0 = time.perf_counter()

        if last_step:
            if master_process:
                ckpt = dict(step=step, model=raw_model.state_dict(), optimizers=[o.state_dict() for o in optimizers])
                torch.save(ckpt, os.path.join(run_dir, f"state_step{step:06d}.pt"))
            break

        x, y = next(train_loader)
        with ctx:
            loss = model(x, y)
        loss.backward()
        frac = min(step / 500, 1)
        optimizer3.param_groups[0]["momentum"] = (1 - frac) * 0.85 + frac * 0.95
        for opt, sched in zip(optimizers, schedulers):
            opt.step()
            sched.step()
        model.zero_grad(set_to_none=True)

        approx_time = training_time_ms + 1000 * (time.perf_counter() - t0)
        log0(f"step:{step + 1}/{args.num_iterations} "
             f"train_time:{approx_time:.0f}ms step_avg:{approx_time / timed_steps:.2f}ms")

    log0(f"peak memory consumption: {torch.cuda.max_memory_allocated() // 1024 // 1024} MiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
