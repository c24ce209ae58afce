#!/usr/bin/env python
"""Decoder-only LM with expert-parallel MoE feed-forward layers.

Every rank owns num_experts // world_size experts. Tokens are routed top-1 and
shipped to the rank that owns their expert with all_to_all. Experts are not
replicated, so there is no DDP: dense gradients are averaged by hand.

    torchrun --nproc_per_node=8 train_moe_lm.py --data /data/owt/train.bin --val_data /data/owt/val.bin
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--val_data", required=True)
    p.add_argument("--out_dir", default="ckpt_moe")
    p.add_argument("--vocab_size", type=int, default=50304)
    p.add_argument("--d_model", type=int, default=768)
    p.add_argument("--n_layer", type=int, default=12)
    p.add_argument("--n_head", type=int, default=12)
    p.add_argument("--num_experts", type=int, default=16)
    p.add_argument("--moe_every", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--aux_coef", type=float, default=0.01)
    p.add_argument("--max_steps", type=int, default=20000)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--eval_every", type=int, default=500)
    p.add_argument("--eval_iters", type=int, default=50)
    p.add_argument("--save_every", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args()


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, in_splits, out_splits):
        ctx.in_splits, ctx.out_splits = in_splits, out_splits
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits,
                               input_split_sizes=in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=ctx.in_splits,
                               input_split_sizes=ctx.out_splits)
        return back, None, None


class Expert(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class MoE(nn.Module):
    def __init__(self, d, num_experts, rank, world_size):
        super().__init__()
        assert num_experts % world_size == 0, "experts must divide evenly over ranks"
        self.E, self.rank, self.ws = num_experts, rank, world_size
        self.local_e = num_experts // world_size
        self.router = nn.Linear(d, num_experts, bias=False)
        self.experts = nn.ModuleList([Expert(d) for _ in range(self.local_e)])
        for p in self.experts.parameters():
            p.is_expert = True

    def forward(self, x):
        B, T, D = x.shape
        x = x.reshape(-1, D)
        probs = self.router(x).float().softmax(-1)
        gate, eid = probs.max(-1)
        frac = F.one_hot(eid, self.E).float().mean(0)
        aux = self.E * (frac * probs.mean(0)).sum()

        order = torch.argsort(eid)
        eid_sorted = eid[order]
        counts = torch.bincount(eid_sorted, minlength=self.E)
        send = counts.view(self.ws, self.local_e).sum(1).tolist()
        recv = send

        tokens = _AllToAll.apply(x[order], send, recv)
        r_eid = _AllToAll.apply(eid_sorted.unsqueeze(1).float(), send, recv).squeeze(1).long()
        r_eid = r_eid - self.rank * self.local_e

        out = torch.empty_like(tokens)
        for i, expert in enumerate(self.experts):
            m = r_eid == i
            out[m] = expert(tokens[m]).to(out.dtype)

        back = _AllToAll.apply(out, recv, send)
        y = torch.empty_like(back)
        y[order] = back
        y = y * gate.unsqueeze(1).to(y.dtype)
        return y.view(B, T, D), aux


class Block(nn.Module):
    def __init__(self, args, use_moe, rank, world_size):
        super().__init__()
        d = args.d_model
        self.n_head = args.n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.use_moe = use_moe
        self.ffn = MoE(d, args.num_experts, rank, world_size) if use_moe else Expert(d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        if self.use_moe:
            h, aux = self.ffn(self.ln2(x))
        else:
            h, aux = self.ffn(self.ln2(x)), x.new_zeros(())
        return x + h, aux


class MoELM(nn.Module):
    def __init__(self, args, rank, world_size):
        super().__init__()
        self.wte = nn.Embedding(args.vocab_size, args.d_model)
        self.wpe = nn.Embedding(args.seq_len, args.d_model)
        self.blocks = nn.ModuleList([
            Block(args, (i + 1) % args.moe_every == 0, rank, world_size) for i in range(args.n_layer)
        ])
        self.ln_f = nn.LayerNorm(args.d_model)
        self.head = nn.Linear(args.d_model, args.vocab_size, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        aux_total = 0.0
        for blk in self.blocks:
            x, aux = blk(x)
            aux_total = aux_total + aux
        logits = self.head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))
        return loss, aux_total


def get_batch(data, args, gen, device):
    ix = torch.randint(len(data) - args.seq_len - 1, (args.batch_size,), generator=gen)
    x = torch.stack([torch.from_numpy(data[i:i + args.seq_len].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + args.seq_len].astype(np.int64)) for i in ix])
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def sync_dense_grads(params, world_size):
    grads = [p.grad for p in params if p.grad is not None]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat.div_(world_size)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.max_steps - args.warmup)
    return 0.1 * args.lr + 0.9 * args.lr * 0.5 * (1 + math.cos(math.pi * t))


@torch.no_grad()
def evaluate(model, val_data, args, device, world_size):
    model.eval()
    gen = torch.Generator().manual_seed(1234 + dist.get_rank())
    total = torch.zeros(1, device=device)
    for _ in range(args.eval_iters):
        x, y = get_batch(val_data, args, gen, device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = model(x, y)
        total += loss.float()
    dist.all_reduce(total)
    model.train()
    return total.item() / (args.eval_iters * world_size)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    torch.manual_seed(args.seed + rank)  # experts differ per rank; dense params are broadcast below
    model = MoELM(args, rank, world_size).to(device)
    dense = [p for p in model.parameters() if not getattr(p, "is_expert", False)]
    expert = [p for p in model.parameters() if getattr(p, "is_expert", False)]
    for p in dense:
        dist.broadcast(p.data, src=0)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ], lr=args.lr, betas=(0.9, 0.95), fused=True)

    train_data = np.memmap(args.data, dtype=np.uint16, mode="r")
    val_data = np.memmap(args.val_data, dtype=np.uint16, mode="r")
    gen = torch.Generator().manual_seed(args.seed + 17 * rank)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"world={world_size} experts/rank={args.num_experts // world_size} "
              f"params/rank={sum(p.numel() for p in model.parameters()) / 1e6:.1f}M")

    t0 = time.time()
    for step in range(args.max_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        x, y = get_batch(train_data, args, gen, device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lm_loss, aux = model(x, y)
            loss = lm_loss + args.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()

        sync_dense_grads(dense, world_size)
        # expert grads already collect tokens from every rank; match the averaged dense grads
        for p in expert:
            if p.grad is not None:
                p.grad.div_(world_size)
        torch.nn.utils.clip_grad_norm_(dense, 1.0)
        opt.step()

        if step % 20 == 0:
            stats = torch.stack([lm_loss.detach().float(), aux.detach().float()])
            dist.all_reduce(stats)
            stats /= world_size
            if rank == 0:
                dt = (time.time() - t0) / 20
                t0 = time.time()
                print(f"step {step} lm {stats[0]:.4f} aux {stats[1]:.3f} lr {lr_at(step, args):.2e} {dt*1000:.0f}ms/it")

        if step > 0 and step % args.eval_every == 0:
            val = evaluate(model, val_data, args, device, world_size)
            if rank == 0:
                print(f"step {step} val_loss {val:.4f}")

        if step > 0 and step % args.save_every == 0:
            experts_sd = {k: v for k, v in model.state_dict().items() if ".experts." in k}
            torch.save(experts_sd, os.path.join(args.out_dir, f"experts_step{step}_rank{rank}.pt"))
            if rank == 0:
                dense_sd = {k: v for k, v in model.state_dict().items() if ".experts." not in k}
                torch.save({"model": dense_sd, "step": step, "world_size": world_size, "args": vars(args)},
                           os.path.join(args.out_dir, f"dense_step{step}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
