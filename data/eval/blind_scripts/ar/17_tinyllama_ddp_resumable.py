"""
Small Llama (160M) pretraining with DDP, resumable to the exact sample.

Data: one uint16 token file, sampled in a fixed global permutation of seq_len windows;
`consumed` counts global windows so a restart continues where the last run stopped.

    torchrun --nnodes=1 --nproc_per_node=8 17_tinyllama_ddp_resumable.py \
        --tokens /data/tinystories_llama/train.bin --ckpt_dir /scratch/$USER/ckpt/llama160m
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaConfig, LlamaForCausalLM


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", required=True)
    p.add_argument("--ckpt_dir", required=True)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--micro_batch", type=int, default=16)
    p.add_argument("--global_batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min_lr", type=float, default=6e-5)
    p.add_argument("--warmup_steps", type=int, default=1000)
    p.add_argument("--max_steps", type=int, default=50000)
    p.add_argument("--save_every", type=int, default=500)
    p.add_argument("--log_every", type=int, default=10)
    return p.parse_args()


class GlobalOrderSampler:
    """Fixed permutation of all windows; rank r takes slots r, r+W, ... of each global batch."""

    def __init__(self, n_windows, seed=0):
        self.perm = np.random.default_rng(seed).permutation(n_windows)

    def indices(self, consumed, global_batch, rank, world, micro_batch, micro_idx):
        base = consumed + micro_idx * micro_batch * world + rank * micro_batch
        return self.perm[np.arange(base, base + micro_batch) % len(self.perm)]


def save_checkpoint(ckpt_dir, model, optimizer, step, consumed):
    path = os.path.join(ckpt_dir, f"step_{step:07d}.pt")
    torch.save({
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "consumed": consumed,
    }, path)
    latest = os.path.join(ckpt_dir, "latest.txt")
    with open(latest, "w") as f:
        f.write(os.path.basename(path))


def load_latest(ckpt_dir, device):
    latest = os.path.join(ckpt_dir, "latest.txt")
    if not os.path.exists(latest):
        return None
    with open(latest) as f:
        name = f.read().strip()
    return torch.load(os.path.join(ckpt_dir, name), map_location=device)


def cosine_lr(step, args):
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    t = min(1.0, (step - args.warmup_steps) / (args.max_steps - args.warmup_steps))
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * t))


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    accum = args.global_batch // (args.micro_batch * world)
    assert accum * args.micro_batch * world == args.global_batch, "global_batch must divide evenly"

    data = np.memmap(args.tokens, dtype=np.uint16, mode="r")
    n_windows = (len(data) - 1) // args.seq_len
    sampler = GlobalOrderSampler(n_windows, seed=1234)

    def fetch(idx):
        rows = [data[i * args.seq_len:i * args.seq_len + args.seq_len + 1] for i in idx]
        t = torch.from_numpy(np.stack(rows).astype(np.int64)).pin_memory().to(device, non_blocking=True)
        return t[:, :-1], t[:, 1:]

    cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, max_position_embeddings=args.seq_len, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    step, consumed = 0, 0
    os.makedirs(args.ckpt_dir, exist_ok=True)
    state = load_latest(args.ckpt_dir, device)
    if state is not None:
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, consumed = state["step"], state["consumed"]
        del state
    if rank == 0:
        print(f"windows {n_windows:,}, accum {accum}, starting at step {step} ({consumed:,} windows consumed)")

    model.train()
    t0 = time.time()
    while step < args.max_steps:
        lr = cosine_lr(step, args)
        for g in optimizer.param_groups:
            g["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        for m in range(accum):
            x, y = fetch(sampler.indices(consumed, args.global_batch, rank, world, args.micro_batch, m))
            ctx = model.no_sync() if m < accum - 1 else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(input_ids=x).logits
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1)) / accum
                loss.backward()
            loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        consumed += args.global_batch

        if step % args.log_every == 0:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
            dt = (time.time() - t0) / args.log_every
            t0 = time.time()
            if rank == 0:
                print(f"step {step} loss {loss_sum.item():.4f} lr {lr:.2e} "
                      f"{args.global_batch * args.seq_len / dt:,.0f} tok/s", flush=True)

        if step % args.save_every == 0:
            save_checkpoint(args.ckpt_dir, model, optimizer, step, consumed)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
