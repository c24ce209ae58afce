"""
GPT-2 (124M) pretraining on FineWeb-10B token shards.
Adapted from llm.c's train_gpt2.py, with Muon for the hidden matrices.

    torchrun --standalone --nproc_per_node=8 train_gpt2.py --wandb_project gpt2-speedrun
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
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP

# -----------------------------------------------------------------------------
# model


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        assert n_embd % n_head == 0
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.c_proj.SCALE_INIT = 1

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=False)
        self.c_proj.SCALE_INIT = 1

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768):
        super().__init__()
        self.n_layer = n_layer
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02
            if hasattr(module, "SCALE_INIT"):
                std *= (2 * self.n_layer) ** -0.5
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        B, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

# -----------------------------------------------------------------------------
# Muon (hidden 2D weights only)


@torch.compile
def zeropower_via_newtonschulz5(G, steps=5):
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    if G.size(0) > G.size(1):
        X = X.T
    X = X / (X.norm() + 1e-7)
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
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                buf = state["momentum_buffer"]
                buf.mul_(group["momentum"]).add_(g)
                g = g.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
                g = zeropower_via_newtonschulz5(g, steps=group["ns_steps"])
                p.add_(g.type_as(p), alpha=-group["lr"] * max(1, p.size(0) / p.size(1)) ** 0.5)

# -----------------------------------------------------------------------------
# data


def _peek_data_shard(filename):
    with open(filename, "rb") as f:
        header = np.frombuffer(f.read(256 * 4), dtype=np.int32)
    assert header[0] == 20240520, "magic number mismatch in the data .bin file"
    assert header[1] == 1, "unsupported version"
    return int(header[2])


def _load_data_shard(filename):
    ntok = _peek_data_shard(filename)
    tokens = np.memmap(filename, dtype=np.uint16, mode="r", offset=256 * 4, shape=(ntok,))
    return tokens


class DistributedDataLoader:
    def __init__(self, filename_pattern, B, T, process_rank, num_processes):
        self.process_rank = process_rank
        self.num_processes = num_processes
        self.B, self.T = B, T
        self.files = sorted(glob.glob(filename_pattern))
        assert len(self.files) > 0, f"did not find any files that match the pattern {filename_pattern}"
        for fname in self.files:
            assert _peek_data_shard(fname) >= num_processes * B * T + 1
        self.reset()

    def reset(self):
        self.current_shard = 0
        self.current_position = self.process_rank * self.B * self.T
        self.tokens = _load_data_shard(self.files[self.current_shard])

    def advance(self):
        self.current_shard = (self.current_shard + 1) % len(self.files)
        self.current_position = self.process_rank * self.B * self.T
        self.tokens = _load_data_shard(self.files[self.current_shard])

    def next_batch(self):
        B, T = self.B, self.T
        buf = self.tokens[self.current_position: self.current_position + B * T + 1]
        buf = torch.from_numpy(buf.astype(np.int64))
        x = buf[:-1].view(B, T)
        y = buf[1:].view(B, T)
        self.current_position += B * T * self.num_processes
        if self.current_position + (B * T * self.num_processes + 1) > len(self.tokens):
            self.advance()
        return x.cuda(non_blocking=True), y.cuda(non_blocking=True)

# -----------------------------------------------------------------------------


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--input_bin", type=str, default="data/fineweb10B/fineweb_train_*.bin")
    p.add_argument("--input_val_bin", type=str, default="data/fineweb10B/fineweb_val_*.bin")
    p.add_argument("--output_dir", type=str, default="logs")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--sequence_length", type=int, default=1024)
    p.add_argument("--total_batch_size", type=int, default=524288)
    p.add_argument("--num_iterations", type=int, default=5100)
    p.add_argument("--adam_lr", type=float, default=0.0018)
    p.add_argument("--muon_lr", type=float, default=0.02)
    p.add_argument("--warmup_iters", type=int, default=250)
    p.add_argument("--warmdown_iters", type=int, default=1450)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--val_loss_every", type=int, default=125)
    p.add_argument("--val_tokens", type=int, default=10485760)
    p.add_argument("--save_every", type=int, default=0)
    p.add_argument("--wandb_project", type=str, default=None)
    p.add_argument("--run_name", type=str, default=None)
    return p.parse_args()


def main():
    args = get_args()
    B, T = args.batch_size, args.sequence_length

    assert torch.cuda.is_available()
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    device = f"cuda:{ddp_local_rank}"
    torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl")
    master_process = ddp_rank == 0

    if args.wandb_project is not None:
        wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    tokens_per_fwdbwd = B * T * ddp_world_size
    assert args.total_batch_size % tokens_per_fwdbwd == 0
    grad_accum_steps = args.total_batch_size // tokens_per_fwdbwd
    if master_process:
        print(f"total desired batch size: {args.total_batch_size}, grad accum steps: {grad_accum_steps}")

    train_loader = DistributedDataLoader(args.input_bin, B, T, ddp_rank, ddp_world_size)
    val_loader = DistributedDataLoader(args.input_val_bin, B, T, ddp_rank, ddp_world_size)
    val_steps = args.val_tokens // tokens_per_fwdbwd

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    model = GPT().cuda()
    model = torch.compile(model)
    model = DDP(model, device_ids=[ddp_local_rank])
    raw_model = model.module

    # embeddings / head / layernorms with Adam, hidden matrices with Muon
    hidden = [p for n, p in raw_model.named_parameters() if p.ndim == 2 and ".h." in n]
    other = [p for n, p in raw_model.named_parameters() if not (p.ndim == 2 and ".h." in n)]
    adam = torch.optim.AdamW(other, lr=args.adam_lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, fused=True)
    muon = Muon(hidden, lr=args.muon_lr, momentum=0.95)
    optimizers = [adam, muon]
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]

    def get_lr_mult(it):
        if it < args.warmup_iters:
            return (it + 1) / args.warmup_iters
        if it < args.num_iterations - args.warmdown_iters:
            return 1.0
        return (args.num_iterations - it) / args.warmdown_iters

    logfile = None
    if master_process:
        os.makedirs(args.output_dir, exist_ok=True)
        logfile = os.path.join(args.output_dir, "main.log")
        open(logfile, "w").close()

    ctx = torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    t0 = time.time()
    for step in range(args.num_iterations + 1):
        last_step = step == args.num_iterations

        if args.val_loss_every > 0 and (step % args.val_loss_every == 0 or last_step):
            model.eval()
            val_loader.reset()
            val_loss = torch.zeros((), device=device)
            with torch.no_grad():
                for _ in range(val_steps):
                    x_val, y_val = val_loader.next_batch()
                    with ctx:
                        _, loss = model(x_val, y_val)
                    val_loss += loss.detach()
            val_loss /= val_steps
            dist.all_reduce(val_loss, op=dist.ReduceOp.AVG)
            if master_process:
                print(f"step {step}/{args.num_iterations} | val loss {val_loss.item():.4f}")
                with open(logfile, "a") as f:
                    f.write(f"s:{step} tel:{val_loss.item()}\n")
                if args.wandb_project is not None:
                    wandb.log({"val/loss": val_loss.item()}, step=step)
            model.train()

        if master_process and (last_step or (args.save_every > 0 and step > 0 and step % args.save_every == 0)):
            ckpt = dict(step=step, model=raw_model.state_dict(), optimizers=[o.state_dict() for o in optimizers])
            torch.save(ckpt, os.path.join(args.output_dir, f"state_step{step:06d}.pt"))

        if last_step:
            break

        model.train()
        loss_accum = torch.zeros((), device=device)
        for micro_step in range(grad_accum_steps):
            x, y = train_loader.next_batch()
            model.require_backward_grad_sync = micro_step == grad_accum_steps - 1
            with ctx:
                _, loss = model(x, y)
                loss = loss / grad_accum_steps
            loss_accum += loss.detach()
            loss.backward()
        dist.all_reduce(loss_accum, op=dist.ReduceOp.AVG)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

        lr_mult = get_lr_mult(step)
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * lr_mult
        for g in muon.param_groups:
            frac = min(step / 300, 1)
            g["momentum"] = (1 - frac) * 0.85 + frac * 0.95
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)

        torch.cuda.synchronize()
        t1 = time.time()
        if master_process:
            tok_per_sec = grad_accum_steps * tokens_per_fwdbwd / (t1 - t0)
            print(f"step {step + 1:5d} | loss {loss_accum.item():.6f} | norm {norm:.4f} | "
                  f"lr_mult {lr_mult:.3f} | {(t1 - t0) * 1000:.1f}ms | {tok_per_sec:.0f} tok/s")
            with open(logfile, "a") as f:
                f.write(f"s:{step} trl:{loss_accum.item()}\n")
            if args.wandb_project is not None:
                wandb.log({"train/loss": loss_accum.item(), "train/lr_mult": lr_mult,
                           "train/grad_norm": norm.item(), "train/tok_per_sec": tok_per_sec}, step=step)
        t0 = t1

    if master_process:
        print(f"peak memory consumption: {torch.cuda.max_memory_allocated() // 1024 // 1024} MiB")
        if args.wandb_project is not None:
            wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
