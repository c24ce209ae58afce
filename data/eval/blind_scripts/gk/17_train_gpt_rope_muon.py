"""
nanoGPT -> speedrun-style changes: rotary embeddings, RMSNorm, ReLU^2, untied head,
Muon for the transformer blocks and AdamW for embeddings and head.

torchrun --standalone --nproc_per_node=8 train_gpt.py
"""
import argparse
import glob
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
class GPTConfig:
    vocab_size: int = 50304
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


def rmsnorm(x, eps=1e-6):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).type_as(x)


class Rotary(nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, T, device):
        t = torch.arange(T, device=device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        return freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]


def apply_rotary_emb(x, cos, sin):
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d].float(), x[..., d:].float()
    return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1).type_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.rotary = Rotary(self.head_dim)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, self.head_dim)
        k = k.view(B, T, self.n_head, self.head_dim)
        v = v.view(B, T, self.n_head, self.head_dim)
        cos, sin = self.rotary(T, x.device)
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attn = CausalSelfAttention(config)
        self.mlp = MLP(config)
        self.attn_scale = 1 / math.sqrt(2 * config.n_layer)

    def forward(self, x):
        x = x + self.attn_scale * self.attn(rmsnorm(x))
        x = x + self.mlp(rmsnorm(x))
        return x


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        for blk in self.transformer.h:
            nn.init.zeros_(blk.attn.c_proj.weight)
            nn.init.zeros_(blk.mlp.c_proj.weight)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        x = rmsnorm(x)
        logits = self.lm_head(x).float()
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@torch.compile
def zeropower_via_newtonschulz5(G, steps=5, eps=1e-7):
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    X /= X.norm() + eps
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
                buf.mul_(group["momentum"]).add_(g)
                if group["nesterov"]:
                    g = g.add(buf, alpha=group["momentum"])
                else:
                    g = buf
                g = zeropower_via_newtonschulz5(g, steps=group["ns_steps"])
                g *= max(1, g.size(0) / g.size(1)) ** 0.5
                p.add_(g.type_as(p), alpha=-group["lr"])


def _peek_data_shard(filename):
    with open(filename, "rb") as f:
        header = np.frombuffer(f.read(256 * 4), dtype=np.int32)
    if header[0] != 20240520:
        raise ValueError(f"magic number mismatch in {filename}")
    return int(header[2])


def _load_data_shard(filename):
    return np.memmap(filename, dtype=np.uint16, mode="r", offset=256 * 4, shape=(_peek_data_shard(filename),))


class DistributedDataLoader:
    def __init__(self, filename_pattern, B, T, process_rank, num_processes):
        self.process_rank = process_rank
        self.num_processes = num_processes
        self.B, self.T = B, T
        self.files = sorted(glob.glob(filename_pattern))
        assert len(self.files) > 0
        self.reset()

    def reset(self):
        self.current_shard = 0
        self.base = 0
        self.tokens = _load_data_shard(self.files[self.current_shard])

    def next_batch(self):
        B, T = self.B, self.T
        start = self.base + self.process_rank * B * T
        buf = torch.from_numpy(self.tokens[start: start + B * T + 1].astype(np.int64))
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        self.base += B * T * self.num_processes
        if self.base + B * T * self.num_processes + 1 > len(self.tokens):
            self.current_shard = (self.current_shard + 1) % len(self.files)
            self.tokens = _load_data_shard(self.files[self.current_shard])
            self.base = 0
        return x.cuda(non_blocking=True), y.cuda(non_blocking=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--input_bin", default="data/fineweb10B/fineweb_train_*.bin")
    parser.add_argument("--input_val_bin", default="data/fineweb10B/fineweb_val_*.bin")
    parser.add_argument("--output_dir", default="logs/rope_muon")
    parser.add_argument("--batch_size", type=int, default=8 * 64)
    parser.add_argument("--device_batch_size", type=int, default=64)
    parser.add_argument("--sequence_length", type=int, default=1024)
    parser.add_argument("--num_iterations", type=int, default=6200)
    parser.add_argument("--learning_rate", type=float, default=0.0036)
    parser.add_argument("--muon_lr", type=float, default=0.02)
    parser.add_argument("--warmup_iters", type=int, default=0)
    parser.add_argument("--warmdown_iters", type=int, default=1800)
    parser.add_argument("--val_loss_every", type=int, default=125)
    parser.add_argument("--val_tokens", type=int, default=10485760)
    args = parser.parse_args()

    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    device = f"cuda:{ddp_local_rank}"
    torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl")
    master_process = ddp_rank == 0

    B, T = args.device_batch_size, args.sequence_length
    assert args.batch_size % (B * ddp_world_size) == 0
    train_accumulation_steps = args.batch_size // (B * ddp_world_size)
    val_steps = args.val_tokens // (B * T * ddp_world_size)

    train_loader = DistributedDataLoader(args.input_bin, B, T, ddp_rank, ddp_world_size)
    val_loader = DistributedDataLoader(args.input_val_bin, B, T, ddp_rank, ddp_world_size)

    model = GPT(GPTConfig()).cuda()
    model = torch.compile(model)
    model = DDP(model, device_ids=[ddp_local_rank])
    raw_model = model.module._orig_mod
    ctx = torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16)

    block_params = list(raw_model.transformer.h.parameters())
    block_ids = {id(p) for p in block_params}
    other_params = [p for p in raw_model.parameters() if id(p) not in block_ids]
    optimizer1 = torch.optim.AdamW(other_params, lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    optimizer2 = Muon(block_params, lr=args.muon_lr, momentum=0.95)
    optimizers = [optimizer1, optimizer2]

    def get_lr(it):
        if it < args.warmup_iters:
            return (it + 1) / args.warmup_iters
        if it < args.num_iterations - args.warmdown_iters:
            return 1.0
        return (args.num_iterations - it) / args.warmdown_iters

    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, get_lr) for opt in optimizers]

    if master_process:
        os.makedirs(args.output_dir, exist_ok=True)
        logfile = os.path.join(args.output_dir, "log.txt")

    training_time_ms = 0.0
    torch.cuda.synchronize()
    t0 = time.time()
    for step in range(args.num_iterations + 1):
        last_step = step == args.num_iterations
        if step == 10:
            training_time_ms = 0.0
            t0 = time.time()

        if last_step or (args.val_loss_every > 0 and step % args.val_loss_every == 0):
            torch.cuda.synchronize()
            training_time_ms += 1000 * (time.time() - t0)
            model.eval()
            val_loader.reset()
            val_loss = torch.zeros((), device=device)
            with torch.no_grad():
                for _ in range(val_steps):
                    x_val, y_val = val_loader.next_batch()
                    with ctx:
                        val_loss += model(x_val, y_val)
            dist.all_reduce(val_loss, op=dist.ReduceOp.AVG)
            val_loss /= val_steps
            if master_process:
                print(f"step:{step}/{args.num_iterations} val_loss:{val_loss.item():.4f} train_time:{training_time_ms:.0f}ms")
                with open(logfile, "a") as f:
                    f.write(f"step:{step}/{args.num_iterations} val_loss:{val_loss.item():.4f}\n")
            model.train()
            torch.cuda.synchronize()
            t0 = time.time()

        if last_step:
            if master_process:
                torch.save({"model": raw_model.state_dict(), "step": step}, os.path.join(args.output_dir, "final.pt"))
            break

        for i in range(1, train_accumulation_steps + 1):
            x, y = train_loader.next_batch()
            model.require_backward_grad_sync = i == train_accumulation_steps
            with ctx:
                loss = model(x, y)
            (loss / train_accumulation_steps).backward()
        for opt, sched in zip(optimizers, schedulers):
            opt.step()
            sched.step()
        model.zero_grad(set_to_none=True)

        if master_process:
            approx_time = training_time_ms + 1000 * (time.time() - t0)
            print(f"step:{step + 1}/{args.num_iterations} train_time:{approx_time:.0f}ms")

    if master_process:
        print(f"peak memory consumption: {torch.cuda.max_memory_allocated() // 1024 // 1024} MiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
