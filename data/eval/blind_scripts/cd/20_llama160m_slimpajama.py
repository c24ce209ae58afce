"""
Pretraining of a 160M Llama-style model on SlimPajama token bins with step checkpoints
(step_XXXXXX.pt + latest symlink) and automatic resume from the latest one.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=trn-head:29500 \
        20_llama160m_slimpajama.py --ckpt_dir /nfs/ckpt/llama160m
"""
import os
import glob
import math
import time
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="/nfs/data/slimpajama_bins")
    p.add_argument("--ckpt_dir", default="/nfs/ckpt/llama160m")
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--n_layers", type=int, default=12)
    p.add_argument("--n_heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--micro_bs", type=int, default=16)
    p.add_argument("--global_bs", type=int, default=256)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup_steps", type=int, default=1000)
    p.add_argument("--max_steps", type=int, default=50000)
    p.add_argument("--eval_every", type=int, default=500)
    p.add_argument("--eval_steps", type=int, default=20)
    p.add_argument("--ckpt_every", type=int, default=1000)
    p.add_argument("--keep_last", type=int, default=3)
    return p.parse_args()


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def precompute_rope(hd, seq_len, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, hd, 2).float() / hd))
    return torch.polar(torch.ones(seq_len, hd // 2), torch.outer(torch.arange(seq_len).float(), freqs))


def apply_rope(x, freqs_cis):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs_cis[: x.size(1)].unsqueeze(0).unsqueeze(2)).flatten(3)
    return out.type_as(x)


class DecoderLayer(nn.Module):
    def __init__(self, d, nh):
        super().__init__()
        self.nh, self.hd = nh, d // nh
        self.attn_norm, self.mlp_norm = RMSNorm(d), RMSNorm(d)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        hidden = 2048
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x, freqs_cis):
        B, T, C = x.shape
        h = self.attn_norm(x)
        q = apply_rope(self.wq(h).view(B, T, self.nh, self.hd), freqs_cis)
        k = apply_rope(self.wk(h).view(B, T, self.nh, self.hd), freqs_cis)
        v = self.wv(h).view(B, T, self.nh, self.hd)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, C))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok_embeddings = nn.Embedding(a.vocab, a.dim)
        self.layers = nn.ModuleList(DecoderLayer(a.dim, a.n_heads) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim)
        self.output = nn.Linear(a.dim, a.vocab, bias=False)
        self.register_buffer("freqs_cis", precompute_rope(a.dim // a.n_heads, a.seq_len), persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens, targets):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.freqs_cis)
        logits = self.output(self.norm(h)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def latest_checkpoint(ckpt_dir):
    files = sorted(glob.glob(os.path.join(ckpt_dir, "step_*.pt")))
    return files[-1] if files else None


def save_checkpoint(ckpt_dir, step, model, opt, args, keep_last):
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, f"step_{step:06d}.pt")
    torch.save({"model": model.module._orig_mod.state_dict(), "opt": opt.state_dict(),
                "step": step, "args": vars(args)}, path)
    link = os.path.join(ckpt_dir, "latest.pt")
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(os.path.basename(path), link)
    for old in sorted(glob.glob(os.path.join(ckpt_dir, "step_*.pt")))[:-keep_last]:
        os.remove(old)


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    assert args.global_bs % (args.micro_bs * world) == 0
    accum = args.global_bs // (args.micro_bs * world)
    tokens_per_step = args.global_bs * args.seq_len

    torch.manual_seed(0)
    model = Llama(args).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    step = 0
    resume_from = latest_checkpoint(args.ckpt_dir)
    if resume_from is not None:
        state = torch.load(resume_from, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        if is_main:
            print(f"resumed from {resume_from} at step {step}")
        del state
    model = DDP(torch.compile(model), device_ids=[local_rank])

    train = np.memmap(os.path.join(args.data_dir, "train.bin"), dtype=np.uint16, mode="r")
    val = np.memmap(os.path.join(args.data_dir, "validation.bin"), dtype=np.uint16, mode="r")
    rng = np.random.default_rng([rank, step])

    def get_batch(data, r):
        starts = r.integers(0, len(data) - args.seq_len - 1, size=args.micro_bs)
        xy = np.stack([data[s:s + args.seq_len + 1] for s in starts]).astype(np.int64)
        xy = torch.from_numpy(xy).pin_memory().to(device, non_blocking=True)
        return xy[:, :-1], xy[:, 1:]

    def lr_at(s):
        if s < args.warmup_steps:
            return args.lr * (s + 1) / args.warmup_steps
        r = min(1.0, (s - args.warmup_steps) / (args.max_steps - args.warmup_steps))
        return args.lr * 0.1 + 0.5 * (args.lr - args.lr * 0.1) * (1.0 + math.cos(math.pi * r))

    @torch.no_grad()
    def evaluate():
        model.eval()
        r = np.random.default_rng([rank, 12345])
        acc = torch.zeros((), device=device)
        for _ in range(args.eval_steps):
            x, y = get_batch(val, r)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                acc += model(x, y)
        dist.all_reduce(acc, op=dist.ReduceOp.AVG)
        model.train()
        return acc.item() / args.eval_steps

    t0 = time.time()
    while step < args.max_steps:
        lr = lr_at(step)
        for g in opt.param_groups:
            g["lr"] = lr
        for micro in range(accum):
            x, y = get_batch(train, rng)
            model.require_backward_grad_sync = micro == accum - 1
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y) / accum
            loss.backward()
        gnorm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        if step % 10 == 0 and is_main:
            torch.cuda.synchronize()
            dt = (time.time() - t0) / 10
            t0 = time.time()
            tps = tokens_per_step / dt
            print(f"step {step} | loss {loss.item() * accum:.4f} | lr {lr:.2e} | gnorm {gnorm.item():.2f} | "
                  f"{tps:,.0f} tok/s | mfu {600 * n_params * tps / (world * 989e12):.1f}%", flush=True)

        if step % args.eval_every == 0:
            vl = evaluate()
            if is_main:
                print(f"step {step} | val_loss {vl:.4f}", flush=True)

        if step % args.ckpt_every == 0:
            save_checkpoint(args.ckpt_dir, step, model, opt, args, args.keep_last)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
