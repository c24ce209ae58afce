#!/usr/bin/env python3
"""Small GPT pre-training on a pre-tokenised corpus, with its own job wrapper.

Launcher (default):
    python 02_torchrun_wrapper_gpt.py --data data/owt --nproc 8 --max-attempts 3

The launcher runs `torchrun ... this_file --worker <args>` in a subprocess,
keeps torchrun's per-rank logs under <out>/attempt_<n>/, and re-runs the job
(the worker resumes from <out>/ckpt.pt) if it exits non-zero.
"""
import argparse
import math
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def get_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true", help="run as a torchrun worker")
    p.add_argument("--nproc", type=int, default=torch.cuda.device_count())
    p.add_argument("--max-attempts", type=int, default=3)
    p.add_argument("--data", default="data/owt")
    p.add_argument("--out", default="out/gpt_small")
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--micro-batch", type=int, default=12)
    p.add_argument("--tokens-per-step", type=int, default=491520, help="global batch in tokens")
    p.add_argument("--max-iters", type=int, default=60000)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min-lr", type=float, default=6e-5)
    p.add_argument("--warmup-iters", type=int, default=2000)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--eval-iters", type=int, default=100)
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- model
class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, batch_first=True, bias=True)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.wte.weight  # weight tying
        self.register_buffer("mask", torch.triu(torch.ones(block_size, block_size, dtype=torch.bool), 1),
                             persistent=False)

    def forward(self, idx, targets=None):
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x, self.mask[:t, :t])
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


# ----------------------------------------------------------------------------- worker
def get_batch(data, block_size, batch, device, gen):
    ix = torch.randint(len(data) - block_size - 1, (batch,), generator=gen)
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


def lr_at(it, args):
    if it < args.warmup_iters:
        return args.lr * (it + 1) / args.warmup_iters
    ratio = min(1.0, (it - args.warmup_iters) / (args.max_iters - args.warmup_iters))
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


def worker(args):
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    device = torch.device("cuda", local_rank)
    master = rank == 0

    tokens_per_micro = args.micro_batch * args.block_size * world_size
    assert args.tokens_per_step % tokens_per_micro == 0, "tokens-per-step must divide evenly"
    accum = args.tokens_per_step // tokens_per_micro

    train_data = np.memmap(os.path.join(args.data, "train.bin"), dtype=np.uint16, mode="r")
    val_data = np.memmap(os.path.join(args.data, "val.bin"), dtype=np.uint16, mode="r")
    # different random windows on every rank
    gen = torch.Generator().manual_seed(args.seed + rank)
    torch.manual_seed(args.seed)

    model = GPT(50304, args.block_size, args.n_layer, args.n_head, args.n_embd).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=True)
    it, best_val = 0, float("inf")
    ckpt_path = os.path.join(args.out, "ckpt.pt")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        it, best_val = ckpt["iter"], ckpt["best_val"]
        gen.manual_seed(args.seed + rank + 1000 * it)
        del ckpt
    model = DDP(model, device_ids=[local_rank])
    raw = model.module
    if master:
        print(f"world={world_size} accum={accum} start_iter={it}", flush=True)

    @torch.no_grad()
    def estimate_loss():
        raw.eval()
        out = {}
        for name, data in (("train", train_data), ("val", val_data)):
            losses = torch.zeros(args.eval_iters, device=device)
            for k in range(args.eval_iters):
                x, y = get_batch(data, args.block_size, args.micro_batch, device, gen)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    _, loss = raw(x, y)
                losses[k] = loss
            mean = losses.mean()
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
            out[name] = mean.item()
        raw.train()
        return out

    t0 = time.time()
    while it < args.max_iters:
        for g in optimizer.param_groups:
            g["lr"] = lr_at(it, args)

        if it % args.eval_every == 0 and it > 0:
            losses = estimate_loss()
            if master:
                print(f"iter {it}: train {losses['train']:.4f} val {losses['val']:.4f}", flush=True)
                if losses["val"] < best_val:
                    best_val = losses["val"]
                ckpt = {"model": raw.state_dict(), "optimizer": optimizer.state_dict(),
                        "iter": it, "best_val": best_val, "args": vars(args)}
                torch.save(ckpt, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
            dist.barrier()

        for micro in range(accum):
            x, y = get_batch(train_data, args.block_size, args.micro_batch, device, gen)
            # only all-reduce gradients on the last micro-step
            model.require_backward_grad_sync = micro == accum - 1
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(x, y)
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if master and it % 10 == 0:
            dt = time.time() - t0
            t0 = time.time()
            print(f"iter {it} loss {loss.item():.4f} lr {lr_at(it, args):.2e} {dt * 100:.0f}ms/it", flush=True)
        it += 1

    dist.destroy_process_group()


# ----------------------------------------------------------------------------- launcher
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher(args, passthrough):
    os.makedirs(args.out, exist_ok=True)
    for attempt in range(1, args.max_attempts + 1):
        log_dir = os.path.join(args.out, f"attempt_{attempt}")
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes=1", f"--nproc-per-node={args.nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            "--max-restarts=0", f"--log-dir={log_dir}", "--redirects=3", "--tee=1",
            os.path.abspath(__file__), "--worker", *passthrough,
        ]
        print(f"[wrapper] attempt {attempt}: {' '.join(cmd)}", flush=True)
        proc = subprocess.Popen(cmd, start_new_session=True)
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
        if rc == 0:
            print("[wrapper] finished", flush=True)
            return 0
        print(f"[wrapper] attempt {attempt} exited with {rc}; logs in {log_dir}", flush=True)
        # make sure nothing from this attempt still holds a GPU
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        time.sleep(15)
    return 1


if __name__ == "__main__":
    args = get_args()
    if args.worker:
        worker(args)
    else:
        forwarded = [a for a in sys.argv[1:]]
        sys.exit(launcher(args, forwarded))
