"""Single-node long-context LM fine-tuning (PG-19, 64k tokens) with causal ring attention.

Launched without torchrun: the script spawns one worker per GPU itself.

    python 07_ring_lm_spawn.py --gpus 8 --cp 4 --data /data/pg19_tok --out /data/runs/ring64k
"""
import argparse
import math
import os
import random
import socket

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- ring attention

def ring_pass(tensors, nxt, prv, group):
    ops, recv = [], []
    for t in tensors:
        r = torch.empty_like(t)
        ops += [dist.P2POp(dist.isend, t, nxt, group), dist.P2POp(dist.irecv, r, prv, group)]
        recv.append(r)
    return dist.batch_isend_irecv(ops), recv


def _scores(q, k, scale, diag):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if diag:
        n = s.size(-1)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


class CausalRingAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, nxt, prv):
        P, r = dist.get_world_size(group), dist.get_rank(group)
        scale = q.size(-1) ** -0.5
        qf = q.float()
        acc = torch.zeros_like(qf)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        kv = [k.contiguous(), v.contiguous()]
        for i in range(P):
            if i < P - 1:
                reqs, nxt_kv = ring_pass(kv, nxt, prv, group)
            src = (r - i) % P
            if src <= r:
                s = _scores(qf, kv[0].float(), scale, diag=(src == r))
                b_lse = s.logsumexp(-1)
                b_out = torch.matmul((s - b_lse[..., None]).exp(), kv[1].float())
                m = torch.logaddexp(lse, b_lse)
                acc = acc * (lse - m).exp()[..., None] + b_out * (b_lse - m).exp()[..., None]
                lse = m
            if i < P - 1:
                for req in reqs:
                    req.wait()
                kv = nxt_kv
        ctx.save_for_backward(q, k, v, acc, lse)
        ctx.comm = (group, nxt, prv)
        return acc.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        group, nxt, prv = ctx.comm
        P, r = dist.get_world_size(group), dist.get_rank(group)
        scale = q.size(-1) ** -0.5
        qf, do = q.float(), do.float()
        delta = (do * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(qf)
        kv = [k.contiguous(), v.contiguous()]
        dkv = [torch.zeros_like(qf), torch.zeros_like(qf)]
        for i in range(P):
            if i < P - 1:
                reqs, nxt_kv = ring_pass(kv, nxt, prv, group)
            src = (r - i) % P
            if src <= r:
                kf, vf = kv[0].float(), kv[1].float()
                p = (_scores(qf, kf, scale, diag=(src == r)) - lse[..., None]).exp()
                dkv[1] += torch.matmul(p.transpose(-1, -2), do)
                ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - delta)
                dq += torch.matmul(ds, kf) * scale
                dkv[0] += torch.matmul(ds.transpose(-1, -2), qf) * scale
            dreqs, dkv = ring_pass(dkv, nxt, prv, group)
            for req in dreqs:
                req.wait()
            if i < P - 1:
                for req in reqs:
                    req.wait()
                kv = nxt_kv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


# --------------------------------------------------------------------------- model

class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, ring):
        B, S, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, S, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = CausalRingAttn.apply(q, k, v, *ring)
        x = x + self.proj(a.transpose(1, 2).reshape(B, S, C))
        return x + self.mlp(self.ln2(x))


class RingGPT(nn.Module):
    def __init__(self, vocab, dim, depth, heads, max_len):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, pos, ring):
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x, ring)
        return self.lm_head(self.ln_f(x))


class Books(Dataset):
    def __init__(self, path, seq_len):
        self.arr = np.load(path, mmap_mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.arr) - 1) // self.seq_len

    def __getitem__(self, i):
        a = self.arr[i * self.seq_len:(i + 1) * self.seq_len + 1].astype(np.int64)
        return torch.from_numpy(a)


# --------------------------------------------------------------------------- worker

def worker(rank, world, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)

    cp = args.cp
    for g in range(world // cp):
        ranks = list(range(g * cp, (g + 1) * cp))
        pg = dist.new_group(ranks)
        if rank in ranks:
            cp_group, cp_ranks = pg, ranks
    cp_rank = cp_ranks.index(rank)
    ring = (cp_group, cp_ranks[(cp_rank + 1) % cp], cp_ranks[(cp_rank - 1) % cp])
    dp_rank, dp_size = rank // cp, world // cp
    chunk = args.seq_len // cp

    torch.manual_seed(args.seed)
    model = RingGPT(50257, args.dim, args.depth, args.heads, args.seq_len).cuda()
    sd = torch.load(args.init, map_location="cpu")
    model.load_state_dict(sd, strict=False)
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    ds = Books(args.data, args.seq_len)
    sampler = DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=1, sampler=sampler, num_workers=2, pin_memory=True, drop_last=True)
    n_steps = args.epochs * len(loader)

    start_epoch = 0
    rng_file = os.path.join(args.out, f"rng_rank{rank}.pt")
    if args.resume and os.path.exists(os.path.join(args.out, "last.pt")):
        ck = torch.load(os.path.join(args.out, "last.pt"), map_location="cpu")
        assert ck["world"] == world and ck["cp"] == cp, "resume needs the same layout"
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start_epoch = ck["epoch"] + 1
        rng = torch.load(rng_file)
        torch.set_rng_state(rng["cpu"])
        torch.cuda.set_rng_state(rng["cuda"])
        random.setstate(rng["py"])

    pos = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device="cuda")[None]
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, seq in enumerate(loader):
            step = epoch * len(loader) + it
            lr = args.lr * min(1.0, (step + 1) / 200) * 0.5 * (1 + math.cos(math.pi * step / n_steps))
            for g in opt.param_groups:
                g["lr"] = lr
            seq = seq.cuda(non_blocking=True)
            x = seq[:, cp_rank * chunk:(cp_rank + 1) * chunk]
            y = seq[:, cp_rank * chunk + 1:(cp_rank + 1) * chunk + 1]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x, pos, ring)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if it % 20 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} it {it}/{len(loader)} loss {l.item():.4f} lr {lr:.2e}", flush=True)

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                        "world": world, "cp": cp}, os.path.join(args.out, "last.pt"))
        torch.save({"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(), "py": random.getstate()},
                   rng_file)
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--data", required=True)
    ap.add_argument("--init", default="/data/models/gpt2-medium-64k-init.pt")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq-len", type=int, default=65536)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    assert args.gpus % args.cp == 0 and args.seq_len % args.cp == 0
    os.makedirs(args.out, exist_ok=True)
    args.port = free_port()
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
