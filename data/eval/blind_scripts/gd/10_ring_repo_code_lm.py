# Repository-level code LM, 256k-token context, causal ring attention over a
# context-parallel group (CP) plus data parallel across CP groups.
#
#   torchrun --nnodes 4 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500 \
#       10_ring_repo_code_lm.py --cp 16 --save-dir /fsx/ckpt/repo256k --resume /fsx/ckpt/repo256k/latest.pt
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


class Ring:
    """Neighbours of this rank inside its CP group (global ranks, as P2POp expects)."""

    def __init__(self, group, ranks):
        self.group, self.size = group, len(ranks)
        self.idx = ranks.index(dist.get_rank())
        self.next, self.prev = ranks[(self.idx + 1) % self.size], ranks[(self.idx - 1) % self.size]

    def shift(self, *tensors):
        bufs = [torch.empty_like(t) for t in tensors]
        ops = []
        for t, b in zip(tensors, bufs):
            ops.append(dist.P2POp(dist.isend, t, self.next, self.group))
            ops.append(dist.P2POp(dist.irecv, b, self.prev, self.group))
        return dist.batch_isend_irecv(ops), bufs


def _block(q, k, scale, diagonal):
    s = (q @ k.transpose(-2, -1)) * scale
    if diagonal:
        L = s.size(-1)
        s = s.masked_fill(torch.triu(torch.ones(L, L, device=s.device, dtype=torch.bool), 1), float("-inf"))
    return s


class RingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring):
        scale = q.shape[-1] ** -0.5
        q32 = q.float()
        o = torch.zeros_like(q32)
        lse = torch.full(q.shape[:-1], -float("inf"), device=q.device)
        kc, vc = k.contiguous(), v.contiguous()
        for step in range(ring.size):
            pending = ring.shift(kc, vc) if step < ring.size - 1 else None
            src = (ring.idx - step) % ring.size
            if src <= ring.idx:
                s = _block(q32, kc.float(), scale, src == ring.idx)
                bl = torch.logsumexp(s, -1)
                new = torch.logaddexp(lse, bl)
                o = o * torch.exp(lse - new).unsqueeze(-1) + (torch.exp(s - bl.unsqueeze(-1)) @ vc.float()) * torch.exp(bl - new).unsqueeze(-1)
                lse = new
            if pending is not None:
                works, (kc, vc) = pending
                for w in works:
                    w.wait()
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, o, lse)
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        ring = ctx.ring
        scale = q.shape[-1] ** -0.5
        q32, do = q.float(), do.float()
        D = (do * o).sum(-1, keepdim=True)
        dq = torch.zeros_like(q32)
        dk, dv = torch.zeros_like(q32), torch.zeros_like(q32)
        kc, vc = k.contiguous(), v.contiguous()
        for step in range(ring.size):
            pending = ring.shift(kc, vc) if step < ring.size - 1 else None
            src = (ring.idx - step) % ring.size
            if src <= ring.idx:
                k32, v32 = kc.float(), vc.float()
                p = torch.exp(_block(q32, k32, scale, src == ring.idx) - lse.unsqueeze(-1))
                dv += p.transpose(-2, -1) @ do
                ds = p * (do @ v32.transpose(-2, -1) - D)
                dq += (ds @ k32) * scale
                dk += (ds.transpose(-2, -1) @ q32) * scale
            works, (dk, dv) = ring.shift(dk, dv)
            for w in works:
                w.wait()
            if pending is not None:
                works, (kc, vc) = pending
                for w in works:
                    w.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


class Block(nn.Module):
    def __init__(self, d, nh):
        super().__init__()
        self.nh = nh
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.wqkv, self.wo = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.w_in, self.w_out = nn.Linear(d, 8 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x, cos, sin, ring):
        B, S, C = x.shape
        q, k, v = self.wqkv(self.norm1(x)).view(B, S, 3, self.nh, C // self.nh).permute(2, 0, 3, 1, 4)
        q = q * cos + torch.cat([-q[..., q.size(-1) // 2:], q[..., :q.size(-1) // 2]], -1) * sin
        k = k * cos + torch.cat([-k[..., k.size(-1) // 2:], k[..., :k.size(-1) // 2]], -1) * sin
        a = RingFn.apply(q.to(v.dtype), k.to(v.dtype), v, ring)
        x = x + self.wo(a.transpose(1, 2).reshape(B, S, C))
        g, u = self.w_in(self.norm2(x)).chunk(2, -1)
        return x + self.w_out(F.silu(g) * u)


class CodeLM(nn.Module):
    def __init__(self, vocab=32768, d=2048, depth=24, nh=16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, nh) for _ in range(depth))
        self.norm = nn.RMSNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.head_dim = d // nh

    def forward(self, ids, pos, ring):
        inv = 1.0 / (1e6 ** (torch.arange(0, self.head_dim, 2, device=ids.device).float() / self.head_dim))
        ang = torch.outer(pos.float(), inv)
        ang = torch.cat([ang, ang], -1)
        cos, sin = ang.cos()[None, None], ang.sin()[None, None]
        x = self.tok(ids)
        for b in self.blocks:
            x = b(x, cos, sin, ring)
        return self.out(self.norm(x))


class RepoShards(Dataset):
    def __init__(self, index, seq_len):
        self.files = [l.strip() for l in open(index) if l.strip()]
        self.seq_len = seq_len

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        toks = np.fromfile(self.files[i], dtype=np.uint16)[: self.seq_len + 1]
        if len(toks) < self.seq_len + 1:
            toks = np.pad(toks, (0, self.seq_len + 1 - len(toks)), constant_values=0)
        return torch.from_numpy(toks.astype(np.int64))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--index", default="/fsx/data/repos_256k/train.txt")
    ap.add_argument("--cp", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=262144)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--total-steps", type=int, default=10000)
    ap.add_argument("--save-every", type=int, default=250)
    ap.add_argument("--save-dir", required=True)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    cp = args.cp
    assert world % cp == 0 and args.seq_len % cp == 0

    ring = None
    for g in range(world // cp):
        ranks = list(range(g * cp, (g + 1) * cp))
        pg = dist.new_group(ranks)
        if rank in ranks:
            ring = Ring(pg, ranks)
    dp_rank, dp_size = rank // cp, world // cp
    L = args.seq_len // cp

    torch.manual_seed(2024)
    model = CodeLM().cuda()
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    step = 0
    if args.resume and os.path.exists(args.resume):
        state = torch.load(args.resume)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        if rank == 0:
            print(f"resumed from {args.resume} at step {step}", flush=True)

    ds = RepoShards(args.index, args.seq_len)
    sampler = DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=7)
    loader = DataLoader(ds, batch_size=1, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    pos = torch.arange(ring.idx * L, (ring.idx + 1) * L, device="cuda")
    epoch = step // len(loader)
    skip = step % len(loader)

    tic = time.time()
    while step < args.total_steps:
        sampler.set_epoch(epoch)
        for i, seq in enumerate(loader):
            if i < skip:
                continue
            seq = seq.cuda(non_blocking=True)
            x = seq[:, ring.idx * L:(ring.idx + 1) * L]
            y = seq[:, ring.idx * L + 1:(ring.idx + 1) * L + 1]
            lr = args.lr * min(1, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(step, args.total_steps) / args.total_steps))
            for g in opt.param_groups:
                g["lr"] = lr
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x, pos, ring)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1), ignore_index=0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1

            if step % 10 == 0:
                rl = loss.detach().clone()
                dist.all_reduce(rl, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {rl.item():.4f} lr {lr:.2e} {(time.time() - tic) / 10:.1f}s/step", flush=True)
                tic = time.time()

            if step % args.save_every == 0:
                if rank == 0:
                    os.makedirs(args.save_dir, exist_ok=True)
                    path = os.path.join(args.save_dir, f"step{step:06d}.pt")
                    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": step}, path)
                    tmp = os.path.join(args.save_dir, "latest.pt.tmp")
                    if os.path.lexists(tmp):
                        os.remove(tmp)
                    os.symlink(os.path.basename(path), tmp)
                    os.replace(tmp, os.path.join(args.save_dir, "latest.pt"))
                dist.barrier()
            if step >= args.total_steps:
                break
        skip = 0
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
