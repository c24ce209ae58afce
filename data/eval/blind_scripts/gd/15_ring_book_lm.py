#!/usr/bin/env python
# Book-length LM continued pretraining at 512k tokens with causal ring attention.
# Context-parallel groups of --cp ranks hold one sequence; DDP syncs gradients over all ranks.
#
#   srun -N8 --ntasks-per-node=1 torchrun --nnodes 8 --nproc_per_node 8 \
#        --rdzv_backend c10d --rdzv_endpoint $(hostname):29500 15_ring_book_lm.py --cp 32
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--train", default="/lustre/data/books_tok/train.bin")
    p.add_argument("--ckpt-dir", default="/lustre/ckpt/book512k")
    p.add_argument("--init", default="/lustre/models/base-7b-style-1b/model.pt")
    p.add_argument("--cp", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=524288)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--n-layer", type=int, default=22)
    p.add_argument("--n-head", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--rope-base", type=float, default=5e6)
    return p.parse_args()


class RingCtx:
    def __init__(self, ranks, group):
        me = dist.get_rank()
        self.group, self.world, self.rank = group, len(ranks), ranks.index(me)
        self.send_peer = ranks[(self.rank + 1) % self.world]
        self.recv_peer = ranks[(self.rank - 1) % self.world]

    def rotate(self, ts):
        outs = [torch.empty_like(t) for t in ts]
        ops = [dist.P2POp(dist.isend, t, self.send_peer, self.group) for t in ts]
        ops += [dist.P2POp(dist.irecv, o, self.recv_peer, self.group) for o in outs]
        return dist.batch_isend_irecv(ops), outs


def attn_block(q, k, v, scale, diag):
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if diag:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, device=s.device, dtype=torch.bool).triu(1), float("-inf"))
    return s


class CausalRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring):
        scale = q.shape[-1] ** -0.5
        q32 = q.float()
        o, lse = torch.zeros_like(q32), torch.full(q.shape[:-1], float("-inf"), device=q.device)
        kv = [k.contiguous(), v.contiguous()]
        for j in range(ring.world):
            if j + 1 < ring.world:
                reqs, nxt = ring.rotate(kv)
            src = (ring.rank - j) % ring.world
            if src <= ring.rank:
                s = attn_block(q32, kv[0].float(), scale, src == ring.rank)
                bl = s.logsumexp(-1)
                m = torch.logaddexp(lse, bl)
                o = o * (lse - m).exp().unsqueeze(-1) + torch.einsum("bhqk,bhkd->bhqd", (s - bl.unsqueeze(-1)).exp(), kv[1].float()) * (bl - m).exp().unsqueeze(-1)
                lse = m
            if j + 1 < ring.world:
                for r in reqs:
                    r.wait()
                kv = nxt
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, o, lse)
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        ring = ctx.ring
        scale = q.shape[-1] ** -0.5
        q32, do = q.float(), do.float()
        delta = (do * o).sum(-1, keepdim=True)
        dq = torch.zeros_like(q32)
        kv = [k.contiguous(), v.contiguous()]
        dkv = [torch.zeros_like(q32), torch.zeros_like(q32)]
        for j in range(ring.world):
            if j + 1 < ring.world:
                reqs, nxt = ring.rotate(kv)
            src = (ring.rank - j) % ring.world
            if src <= ring.rank:
                k32, v32 = kv[0].float(), kv[1].float()
                p = (attn_block(q32, k32, scale, src == ring.rank) - lse.unsqueeze(-1)).exp()
                dkv[1] += torch.einsum("bhqk,bhqd->bhkd", p, do)
                ds = p * (torch.einsum("bhqd,bhkd->bhqk", do, v32) - delta)
                dq += torch.einsum("bhqk,bhkd->bhqd", ds, k32) * scale
                dkv[0] += torch.einsum("bhqk,bhqd->bhkd", ds, q32) * scale
            dreqs, dkv = ring.rotate(dkv)
            for r in dreqs:
                r.wait()
            if j + 1 < ring.world:
                for r in reqs:
                    r.wait()
                kv = nxt
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def rope(x, cos, sin):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return (x * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class Layer(nn.Module):
    def __init__(self, dim, n_head):
        super().__init__()
        self.n_head = n_head
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim, eps=1e-5), nn.RMSNorm(dim, eps=1e-5)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(dim, 5632, bias=False), nn.Linear(dim, 5632, bias=False)
        self.down = nn.Linear(5632, dim, bias=False)

    def forward(self, x, cos, sin, ring):
        B, S, C = x.shape
        h = self.attn_norm(x)
        split = lambda t: t.view(B, S, self.n_head, C // self.n_head).transpose(1, 2)
        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        a = CausalRing.apply(rope(q, cos, sin), rope(k, cos, sin), v, ring)
        x = x + self.o(a.transpose(1, 2).reshape(B, S, C))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class BookLM(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed = nn.Embedding(a.vocab, a.dim)
        self.layers = nn.ModuleList(Layer(a.dim, a.n_head) for _ in range(a.n_layer))
        self.norm = nn.RMSNorm(a.dim, eps=1e-5)
        self.lm_head = nn.Linear(a.dim, a.vocab, bias=False)

    def forward(self, ids, cos, sin, ring):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, cos, sin, ring)
        return self.lm_head(self.norm(x))


class Windows(Dataset):
    def __init__(self, path, n):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.n = n

    def __len__(self):
        return (len(self.data) - 1) // self.n

    def __getitem__(self, i):
        return torch.from_numpy(self.data[i * self.n:(i + 1) * self.n + 1].astype(np.int64))


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    cp = args.cp

    ring = None
    for base in range(0, world, cp):
        ranks = list(range(base, base + cp))
        g = dist.new_group(ranks)
        if rank in ranks:
            ring = RingCtx(ranks, g)
    dp_rank, dp_size = rank // cp, world // cp
    L = args.seq_len // cp

    model = BookLM(args)
    model.load_state_dict(torch.load(args.init, map_location="cpu"))
    model = DDP(model.cuda(), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)

    hd = args.dim // args.n_head
    inv = 1.0 / args.rope_base ** (torch.arange(0, hd, 2, device="cuda").float() / hd)
    ang = torch.outer(torch.arange(ring.rank * L, (ring.rank + 1) * L, device="cuda").float(), inv)
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos()[None, None], ang.sin()[None, None]

    ds = Windows(args.train, args.seq_len)
    sampler = DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=1, sampler=sampler, num_workers=2, pin_memory=True, drop_last=True)
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    step, epoch = 0, 0
    t_last = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for seq in loader:
            seq = seq.cuda(non_blocking=True)
            x = seq[:, ring.rank * L:(ring.rank + 1) * L]
            y = seq[:, ring.rank * L + 1:(ring.rank + 1) * L + 1]
            lr = args.lr * min(1.0, (step + 1) / 20)
            for g in opt.param_groups:
                g["lr"] = lr

            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x, cos, sin, ring)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            if not torch.isfinite(loss):
                print(f"[rank {rank}] non-finite loss at step {step}, skipping batch", flush=True)
                opt.zero_grad(set_to_none=True)
                continue
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1

            if step % 5 == 0:
                rep = torch.stack([loss.detach(), gn.detach().float()])
                dist.all_reduce(rep, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {rep[0].item():.4f} gnorm {rep[1].item():.3f} lr {lr:.2e} "
                          f"{(time.time() - t_last) / 5:.1f}s/it", flush=True)
                t_last = time.time()
            if step % 100 == 0 or step == args.steps:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                               os.path.join(args.ckpt_dir, f"step_{step:05d}.pt"))
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
