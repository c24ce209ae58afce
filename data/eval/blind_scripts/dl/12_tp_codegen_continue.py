"""Continued pretraining of a GPT-2-vocabulary code model with tensor parallelism.

The vocabulary (50257, GPT-2 tokenizer) is not padded; the last tensor-parallel
rank simply owns a few rows fewer.

    torchrun --nproc_per_node=8 12_tp_codegen_continue.py --tp 4 --train data/code_train.bin --val data/code_val.bin
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class ParallelCtx:
    def __init__(self, tp):
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.tp, self.dp = tp, self.world // tp
        self.tp_rank, self.dp_rank = self.rank % tp, self.rank // tp
        self.tp_group = self.dp_group = None
        for i in range(self.dp):
            g = dist.new_group(list(range(i * tp, (i + 1) * tp)))
            if i == self.dp_rank:
                self.tp_group = g
        for j in range(tp):
            g = dist.new_group(list(range(j, self.world, tp)))
            if j == self.tp_rank:
                self.dp_group = g


PC: ParallelCtx = None


class Broadcast(torch.autograd.Function):
    """identity forward, all-reduce backward (input of a column-parallel layer)"""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=PC.tp_group)
        return g


class AllReduce(torch.autograd.Function):
    """all-reduce forward, identity backward (output of a row-parallel layer)"""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        dist.all_reduce(x, group=PC.tp_group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


def take(full, dim):
    return nn.Parameter(full.chunk(PC.tp, dim)[PC.tp_rank].clone())


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc_w = take(torch.randn(4 * d, d) * 0.02, 0)
        self.c_fc_b = take(torch.zeros(4 * d), 0)
        self.c_proj_w = take(torch.randn(d, 4 * d) * 0.02, 1)
        self.c_proj_b = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        h = F.gelu(F.linear(Broadcast.apply(x), self.c_fc_w, self.c_fc_b), approximate="tanh")
        return AllReduce.apply(F.linear(h, self.c_proj_w)) + self.c_proj_b


class SelfAttention(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.nh, self.hd = n_head // PC.tp, d // n_head
        self.c_attn_w = take(torch.randn(3 * d, d) * 0.02, 0)
        self.c_attn_b = take(torch.zeros(3 * d), 0)
        self.c_proj_w = take(torch.randn(d, d) * 0.02, 1)
        self.c_proj_b = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        B, T, _ = x.shape
        qkv = F.linear(Broadcast.apply(x), self.c_attn_w, self.c_attn_b)
        q, k, v = qkv.view(B, T, self.nh, 3 * self.hd).transpose(1, 2).split(self.hd, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        return AllReduce.apply(F.linear(y, self.c_proj_w)) + self.c_proj_b


class Block(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), SelfAttention(d, n_head)
        self.ln_2, self.mlp = nn.LayerNorm(d), MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CodeGPT(nn.Module):
    def __init__(self, vocab, d, n_head, n_layer, ctx):
        super().__init__()
        per = math.ceil(vocab / PC.tp)
        self.v0 = min(PC.tp_rank * per, vocab)
        self.v1 = min(self.v0 + per, vocab)
        full = torch.randn(vocab, d) * 0.02
        self.wte = nn.Parameter(full[self.v0:self.v1].clone())
        self.wpe = nn.Embedding(ctx, d)
        self.h = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx, tgt):
        miss = (idx < self.v0) | (idx >= self.v1)
        tok = F.embedding((idx - self.v0).masked_fill(miss, 0), self.wte).masked_fill(miss[..., None], 0.0)
        x = AllReduce.apply(tok) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for blk in self.h:
            x = blk(x)
        logits = F.linear(Broadcast.apply(self.ln_f(x)), self.wte).float()  # (B, T, v1 - v0)
        return vocab_parallel_xent(logits, tgt, self.v0, self.v1)


def vocab_parallel_xent(logits, tgt, v0, v1):
    with torch.no_grad():
        m = logits.amax(-1, keepdim=True)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=PC.tp_group)
    z = logits - m
    lse = AllReduce.apply(z.exp().sum(-1)).log()
    hit = (tgt >= v0) & (tgt < v1)
    idx = (tgt - v0).clamp(0, v1 - v0 - 1)
    zt = AllReduce.apply(z.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * hit)
    return (lse - zt).mean()


class Tokens(Dataset):
    def __init__(self, path, ctx):
        self.d, self.ctx = np.memmap(path, dtype=np.uint16, mode="r"), ctx

    def __len__(self):
        return (len(self.d) - 1) // self.ctx

    def __getitem__(self, i):
        a = torch.from_numpy(self.d[i * self.ctx:(i + 1) * self.ctx + 1].astype(np.int64))
        return a[:-1], a[1:]


@torch.no_grad()
def evaluate(model, loader, max_batches=100):
    model.eval()
    s = torch.zeros(2, device="cuda")
    for i, (x, y) in enumerate(loader):
        if i >= max_batches:
            break
        with torch.autocast("cuda", dtype=torch.bfloat16):
            s[0] += model(x.cuda(), y.cuda())
        s[1] += 1
    dist.all_reduce(s, group=PC.dp_group)
    model.train()
    return (s[0] / s[1]).item()


def main():
    global PC
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--init", default=None, help="directory with per-tp-rank shards")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--d", type=int, default=2560)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--iters", type=int, default=30000)
    ap.add_argument("--out", default="ckpt/codegpt")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    PC = ParallelCtx(args.tp)
    torch.manual_seed(2024)

    net = CodeGPT(50257, args.d, args.heads, args.layers, args.ctx)
    if args.init:
        net.load_state_dict(torch.load(os.path.join(args.init, f"tp{PC.tp_rank}.pt"), map_location="cpu"))
    net = net.cuda()
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.iters, eta_min=args.lr / 10)

    tr, va = Tokens(args.train, args.ctx), Tokens(args.val, args.ctx)
    tr_s = DistributedSampler(tr, num_replicas=PC.dp, rank=PC.dp_rank, shuffle=True, seed=0)
    va_s = DistributedSampler(va, num_replicas=PC.dp, rank=PC.dp_rank, shuffle=False)
    tr_dl = DataLoader(tr, batch_size=args.bs, sampler=tr_s, num_workers=4, pin_memory=True, drop_last=True)
    va_dl = DataLoader(va, batch_size=args.bs, sampler=va_s, num_workers=2, drop_last=True)

    it, ep, t0 = 0, 0, time.time()
    while it < args.iters:
        tr_s.set_epoch(ep)
        for x, y in tr_dl:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x.cuda(non_blocking=True), y.cuda(non_blocking=True))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            it += 1
            if it % 25 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG, group=PC.dp_group)
                if PC.rank == 0:
                    print(f"it {it} loss {l.item():.4f} {(time.time() - t0) / 25 * 1e3:.0f} ms/it", flush=True)
                    t0 = time.time()
            if it % 1000 == 0:
                vl = evaluate(model, va_dl)
                if PC.rank == 0:
                    print(f"it {it} val_loss {vl:.4f} val_ppl {math.exp(vl):.2f}", flush=True)
                if PC.dp_rank == 0:
                    os.makedirs(args.out, exist_ok=True)
                    torch.save(net.state_dict(), os.path.join(args.out, f"it{it}_tp{PC.tp_rank}.pt"))
                dist.barrier()
            if it >= args.iters:
                break
        ep += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
