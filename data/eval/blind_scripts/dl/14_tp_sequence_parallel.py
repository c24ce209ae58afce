"""Tensor + sequence parallel GPT (Megatron-LM style SP), data parallel over TP groups.

Activations outside the attention / MLP blocks are split along the sequence
dimension across the tensor-parallel ranks; column-parallel layers all-gather
the sequence, row-parallel layers reduce-scatter it.

    torchrun --nproc_per_node=8 14_tp_sequence_parallel.py --tp 8 --data /data/tokens/train.bin
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TP_GROUP = DP_GROUP = None
TP_SIZE = TP_RANK = DP_SIZE = DP_RANK = 1


def init_groups(tp):
    global TP_GROUP, DP_GROUP, TP_SIZE, TP_RANK, DP_SIZE, DP_RANK
    world, rank = dist.get_world_size(), dist.get_rank()
    TP_SIZE, TP_RANK, DP_SIZE, DP_RANK = tp, rank % tp, world // tp, rank // tp
    for i in range(DP_SIZE):
        g = dist.new_group(list(range(i * tp, (i + 1) * tp)))
        if i == DP_RANK:
            TP_GROUP = g
    for j in range(tp):
        g = dist.new_group(list(range(j, world, tp)))
        if j == TP_RANK:
            DP_GROUP = g


class GatherSeq(torch.autograd.Function):
    """all-gather along the sequence dim; backward reduce-scatters"""

    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(TP_SIZE)]
        dist.all_gather(parts, x.contiguous(), group=TP_GROUP)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, g):
        chunks = [c.contiguous() for c in g.chunk(TP_SIZE, dim=1)]
        out = torch.empty_like(chunks[0])
        dist.reduce_scatter(out, chunks, group=TP_GROUP)
        return out


class ReduceScatterSeq(torch.autograd.Function):
    """sum partial results and keep this rank's sequence chunk; backward all-gathers"""

    @staticmethod
    def forward(ctx, x):
        chunks = [c.contiguous() for c in x.chunk(TP_SIZE, dim=1)]
        out = torch.empty_like(chunks[0])
        dist.reduce_scatter(out, chunks, group=TP_GROUP)
        return out

    @staticmethod
    def backward(ctx, g):
        parts = [torch.empty_like(g) for _ in range(TP_SIZE)]
        dist.all_gather(parts, g.contiguous(), group=TP_GROUP)
        return torch.cat(parts, dim=1)


class SplitSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.chunk(TP_SIZE, dim=1)[TP_RANK].contiguous()

    @staticmethod
    def backward(ctx, g):
        parts = [torch.empty_like(g) for _ in range(TP_SIZE)]
        dist.all_gather(parts, g.contiguous(), group=TP_GROUP)
        return torch.cat(parts, dim=1)


class AllReduceFwd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        dist.all_reduce(x, group=TP_GROUP)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


def sp_norm(d):
    ln = nn.LayerNorm(d)
    for p in ln.parameters():
        p.sequence_parallel = True  # sees only a slice of the sequence -> grads are partial
    return ln


class SPBlock(nn.Module):
    def __init__(self, d, nh):
        super().__init__()
        self.nh, self.hd = nh // TP_SIZE, d // nh
        self.ln1, self.ln2 = sp_norm(d), sp_norm(d)
        self.w_qkv = nn.Parameter(torch.randn(3 * d // TP_SIZE, d) * 0.02)
        self.w_o = nn.Parameter(torch.randn(d, d // TP_SIZE) * 0.02 / math.sqrt(2))
        self.w_in = nn.Parameter(torch.randn(4 * d // TP_SIZE, d) * 0.02)
        self.w_out = nn.Parameter(torch.randn(d, 4 * d // TP_SIZE) * 0.02 / math.sqrt(2))

    def forward(self, x):  # x: (B, T/tp, d)
        h = GatherSeq.apply(self.ln1(x))
        B, T, _ = h.shape
        q, k, v = F.linear(h, self.w_qkv).view(B, T, self.nh, 3 * self.hd).transpose(1, 2).split(self.hd, -1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + ReduceScatterSeq.apply(F.linear(a, self.w_o))
        h = GatherSeq.apply(self.ln2(x))
        return x + ReduceScatterSeq.apply(F.linear(F.gelu(F.linear(h, self.w_in)), self.w_out))


class SPGPT(nn.Module):
    def __init__(self, vocab, d, nh, nl, seq):
        super().__init__()
        self.vp = vocab // TP_SIZE
        self.v0 = TP_RANK * self.vp
        self.wte = nn.Parameter(torch.randn(self.vp, d) * 0.02)
        self.wpe = nn.Parameter(torch.randn(seq, d) * 0.01)
        self.blocks = nn.ModuleList(SPBlock(d, nh) for _ in range(nl))
        self.ln_f = sp_norm(d)

    def forward(self, ids, tgt):
        off = ids - self.v0
        oob = (off < 0) | (off >= self.vp)
        e = F.embedding(off.masked_fill(oob, 0), self.wte).masked_fill(oob[..., None], 0.0)
        x = SplitSeq.apply(AllReduceFwd.apply(e) + self.wpe[: ids.size(1)])
        for blk in self.blocks:
            x = blk(x)
        h = GatherSeq.apply(self.ln_f(x))
        logits = F.linear(h, self.wte).float()  # (B, T, vocab/tp)
        with torch.no_grad():
            mx = logits.amax(-1, keepdim=True)
            dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=TP_GROUP)
        z = logits - mx
        lse = AllReduceFwd.apply(z.exp().sum(-1)).log()
        inside = (tgt >= self.v0) & (tgt < self.v0 + self.vp)
        zt = z.gather(-1, (tgt - self.v0).clamp(0, self.vp - 1).unsqueeze(-1)).squeeze(-1) * inside
        return (lse - AllReduceFwd.apply(zt)).mean()


class Bin(Dataset):
    def __init__(self, path, seq):
        self.a, self.seq = np.memmap(path, dtype=np.uint16, mode="r"), seq

    def __len__(self):
        return (len(self.a) - 1) // self.seq

    def __getitem__(self, i):
        t = torch.from_numpy(self.a[i * self.seq:(i + 1) * self.seq + 1].astype(np.int64))
        return t[:-1], t[1:]


def sync_grads(model):
    sp = [p.grad for p in model.parameters() if getattr(p, "sequence_parallel", False)]
    for g in sp:
        dist.all_reduce(g, group=TP_GROUP)
    for p in model.parameters():
        p.grad.div_(DP_SIZE)
        dist.all_reduce(p.grad, group=DP_GROUP)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1.5e-4)
    ap.add_argument("--iters", type=int, default=100000)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--save", default="ckpt/sp_gpt")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    if args.seed is None:
        seed = torch.randint(0, 2 ** 31 - 1, (1,), device="cuda")
        dist.broadcast(seed, src=0)
        args.seed = int(seed.item())
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    init_groups(args.tp)
    torch.manual_seed(args.seed + TP_RANK)  # different shards on different TP ranks
    assert args.seq % args.tp == 0

    model = SPGPT(args.vocab, args.d, args.heads, args.layers, args.seq)
    # replicated parameters must match across TP ranks: take them from TP rank 0
    src = dist.get_rank() - TP_RANK
    for name, p in model.named_parameters():
        if getattr(p, "sequence_parallel", False) or name == "wpe":
            p.data = p.data.cuda()
            dist.broadcast(p.data, src=src, group=TP_GROUP)
    model = model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.iters))))

    ds = Bin(args.data, args.seq)
    sampler = DistributedSampler(ds, num_replicas=DP_SIZE, rank=DP_RANK, shuffle=True, seed=args.seed)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    it, ep, t0 = 0, 0, time.time()
    while it < args.iters:
        sampler.set_epoch(ep)
        for x, y in dl:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x.cuda(non_blocking=True), y.cuda(non_blocking=True))
            opt.zero_grad(set_to_none=False)
            loss.backward()
            sync_grads(model)
            opt.step()
            sched.step()
            it += 1
            if it % 10 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG, group=DP_GROUP)
                if dist.get_rank() == 0:
                    print(f"iter {it} loss {l.item():.4f} {(time.time() - t0) * 100:.0f} ms/iter", flush=True)
                    t0 = time.time()
            if it % 2000 == 0:
                if DP_RANK == 0:
                    os.makedirs(args.save, exist_ok=True)
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "it": it, "seed": args.seed},
                               os.path.join(args.save, f"iter{it:07d}_tp{TP_RANK}.pt"))
                dist.barrier()
            if it >= args.iters:
                break
        ep += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
