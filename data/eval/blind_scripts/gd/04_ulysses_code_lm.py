"""
Continued pretraining of a code LM at 64k context with DeepSpeed-Ulysses style
sequence parallelism written directly on torch.distributed.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        04_ulysses_code_lm.py --sp 8 --ckpt /shared/ckpt/code-1.3b-64k
"""
import argparse
import logging
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

log = logging.getLogger("train")


@dataclass
class ParallelState:
    rank: int
    world: int
    local_rank: int
    sp_size: int
    sp_rank: int
    dp_size: int
    dp_rank: int
    sp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup


def setup_parallel(sp_size):
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    if world % sp_size:
        raise ValueError(f"world size {world} not divisible by sp {sp_size}")
    dp_size = world // sp_size

    # rank = dp_rank * sp_size + sp_rank, so an SP group stays inside one node
    sp_rank, dp_rank = rank % sp_size, rank // sp_size
    sp_ranks = [dp_rank * sp_size + i for i in range(sp_size)]
    dp_ranks = [j * sp_size + sp_rank for j in range(dp_size)]
    sp_group = dist.new_group(sp_ranks)
    dp_group = dist.new_group(dp_ranks)
    return ParallelState(rank, world, local_rank, sp_size, sp_rank, dp_size, dp_rank, sp_group, dp_group)


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, x, scatter_idx, gather_idx):
        ctx.group, ctx.scatter_idx, ctx.gather_idx = group, scatter_idx, gather_idx
        world = dist.get_world_size(group)
        ins = [t.contiguous() for t in torch.tensor_split(x, world, scatter_idx)]
        outs = [torch.empty_like(ins[0]) for _ in range(world)]
        dist.all_to_all(outs, ins, group=group)
        return torch.cat(outs, dim=gather_idx).contiguous()

    @staticmethod
    def backward(ctx, *grads):
        return (None, _SeqAllToAll.apply(ctx.group, *grads, ctx.gather_idx, ctx.scatter_idx), None, None)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, group):
        super().__init__()
        self.h, self.kvh, self.hd = n_heads, n_kv_heads, dim // n_heads
        self.group = group
        self.wq = nn.Linear(dim, n_heads * self.hd, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(n_heads * self.hd, dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = rotate(self.wq(x).view(b, s, self.h, self.hd), cos, sin)
        k = rotate(self.wk(x).view(b, s, self.kvh, self.hd), cos, sin)
        v = self.wv(x).view(b, s, self.kvh, self.hd)
        q = _SeqAllToAll.apply(self.group, q, 2, 1)
        k = _SeqAllToAll.apply(self.group, k, 2, 1)
        v = _SeqAllToAll.apply(self.group, v, 2, 1)
        rep = q.size(2) // k.size(2)
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        o = _SeqAllToAll.apply(self.group, o.transpose(1, 2), 1, 2)
        return self.wo(o.reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, ffn, group):
        super().__init__()
        self.attn_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.attn = Attention(dim, n_heads, n_kv_heads, group)
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class CodeLM(nn.Module):
    def __init__(self, vocab, dim, layers, n_heads, n_kv_heads, ffn, group):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, n_kv_heads, ffn, group) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, cos, sin):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.out(self.norm(h))


def rope_tables(seq_len, head_dim, theta, device):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    f = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    emb = torch.cat([f, f], dim=-1)
    return emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]


class PackedCode(Dataset):
    def __init__(self, path, seq_len):
        self.data = np.load(path, mmap_mode="r")  # [n_docs_packed, seq_len + 1] int32
        assert self.data.shape[1] == seq_len + 1

    def __len__(self):
        return self.data.shape[0]

    def __getitem__(self, i):
        return torch.from_numpy(self.data[i].astype(np.int64))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/shared/data/stack_v2_packed_64k.npy")
    ap.add_argument("--init", default="/shared/models/code-1.3b-4k/consolidated.pt")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--sp", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=65536)
    ap.add_argument("--rope-theta", type=float, default=500000.0)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--grad-accum", type=int, default=4)
    args = ap.parse_args()

    ps = setup_parallel(args.sp)
    logging.basicConfig(level=logging.INFO if ps.rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    model = CodeLM(vocab=49152, dim=2048, layers=24, n_heads=16, n_kv_heads=8, ffn=8192, group=ps.sp_group)
    state = torch.load(args.init, map_location="cpu")
    model.load_state_dict(state)
    model = DDP(model.cuda(), device_ids=[ps.local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))

    chunk = args.seq_len // args.sp
    cos, sin = rope_tables(args.seq_len, 2048 // 16, args.rope_theta, "cuda")
    cos = cos[:, ps.sp_rank * chunk:(ps.sp_rank + 1) * chunk]
    sin = sin[:, ps.sp_rank * chunk:(ps.sp_rank + 1) * chunk]

    ds = PackedCode(args.data, args.seq_len)
    sampler = DistributedSampler(ds, num_replicas=ps.dp_size, rank=ps.dp_rank, shuffle=True, seed=17)
    loader = DataLoader(ds, batch_size=1, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    os.makedirs(args.ckpt, exist_ok=True)
    step, epoch, micro = 0, 0, 0
    data_iter = iter(loader)
    model.train()
    while step < args.steps:
        try:
            seq = next(data_iter)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            data_iter = iter(loader)
            seq = next(data_iter)
        seq = seq.cuda(non_blocking=True)
        x = seq[:, :-1][:, ps.sp_rank * chunk:(ps.sp_rank + 1) * chunk]
        y = seq[:, 1:][:, ps.sp_rank * chunk:(ps.sp_rank + 1) * chunk]

        sync = (micro + 1) % args.grad_accum == 0
        ctx = model.no_sync() if not sync else torch.enable_grad()
        with ctx:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x, cos, sin)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / args.grad_accum
            loss.backward()
        micro += 1
        if not sync:
            continue

        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        if step % 10 == 0:
            rep = loss.detach() * args.grad_accum
            dist.all_reduce(rep, group=ps.dp_group, op=dist.ReduceOp.AVG)
            dist.all_reduce(rep, group=ps.sp_group, op=dist.ReduceOp.AVG)
            log.info("step %d loss %.4f lr %.3e", step, rep.item(), sched.get_last_lr()[0])

        if step % 500 == 0 or step == args.steps:
            if ps.rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                           os.path.join(args.ckpt, f"step{step}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
