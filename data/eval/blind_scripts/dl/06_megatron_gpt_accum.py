"""Megatron-style GPT training: tensor parallel within a node, data parallel across.

    # 2 nodes x 8 GPUs, TP=8, DP=2
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29400 \
        06_megatron_gpt_accum.py --tp 8 --data /lustre/tok/pile_train.bin --save /lustre/ckpt/gpt_1b3
"""
import argparse
import contextlib
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MP:
    tp_group = dp_group = None
    tp_rank = tp_size = dp_rank = dp_size = 0


def initialize_model_parallel(tp):
    world, rank = dist.get_world_size(), dist.get_rank()
    MP.tp_size, MP.dp_size = tp, world // tp
    for start in range(0, world, tp):
        ranks = list(range(start, start + tp))
        g = dist.new_group(ranks)
        if rank in ranks:
            MP.tp_group = g
    for offset in range(tp):
        ranks = list(range(offset, world, tp))
        g = dist.new_group(ranks)
        if rank in ranks:
            MP.dp_group = g
    MP.tp_rank, MP.dp_rank = rank % tp, rank // tp


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        if MP.tp_size == 1:
            return g
        g = g.contiguous()
        dist.all_reduce(g, group=MP.tp_group)
        return g


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        if MP.tp_size == 1:
            return x
        x = x.contiguous()
        dist.all_reduce(x, group=MP.tp_group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


def _split_param(full, dim):
    p = nn.Parameter(full.chunk(MP.tp_size, dim=dim)[MP.tp_rank].contiguous())
    p.model_parallel = True
    return p


class ColumnLinear(nn.Module):
    def __init__(self, fin, fout, std):
        super().__init__()
        self.weight = _split_param(torch.randn(fout, fin) * std, 0)
        self.bias = _split_param(torch.zeros(fout), 0)

    def forward(self, x):
        return F.linear(_Copy.apply(x), self.weight, self.bias)


class RowLinear(nn.Module):
    def __init__(self, fin, fout, std):
        super().__init__()
        self.weight = _split_param(torch.randn(fout, fin) * std, 1)
        self.bias = nn.Parameter(torch.zeros(fout))

    def forward(self, x):
        return _Reduce.apply(F.linear(x, self.weight)) + self.bias


class VocabEmbedding(nn.Module):
    def __init__(self, vocab, d):
        super().__init__()
        assert vocab % MP.tp_size == 0
        self.n = vocab // MP.tp_size
        self.lo, self.hi = MP.tp_rank * self.n, (MP.tp_rank + 1) * self.n
        self.weight = _split_param(torch.randn(vocab, d) * 0.02, 0)

    def forward(self, ids):
        oob = (ids < self.lo) | (ids >= self.hi)
        local = ids.clone() - self.lo
        local[oob] = 0
        e = F.embedding(local, self.weight)
        e[oob, :] = 0.0
        return _Reduce.apply(e)


class _ParallelXent(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, lo, hi):
        logits = logits.float()
        m = logits.max(-1)[0]
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=MP.tp_group)
        logits = logits - m.unsqueeze(-1)
        oob = (target < lo) | (target >= hi)
        t = target.clone() - lo
        t[oob] = 0
        flat = logits.view(-1, logits.size(-1))
        idx = torch.arange(flat.size(0), device=flat.device)
        tgt_logit = flat[idx, t.view(-1)].clone().view_as(target)
        tgt_logit[oob] = 0.0
        dist.all_reduce(tgt_logit, group=MP.tp_group)
        e = logits.exp()
        s = e.sum(-1)
        dist.all_reduce(s, group=MP.tp_group)
        e.div_(s.unsqueeze(-1))
        ctx.save_for_backward(e, oob, t)
        return s.log() - tgt_logit

    @staticmethod
    def backward(ctx, g):
        sm, oob, t = ctx.saved_tensors
        flat = sm.view(-1, sm.size(-1))
        idx = torch.arange(flat.size(0), device=flat.device)
        flat[idx, t.view(-1)] -= 1.0 - oob.view(-1).float()
        return sm * g.unsqueeze(-1), None, None, None


class Layer(nn.Module):
    def __init__(self, d, heads, n_layers):
        super().__init__()
        std, out_std = 0.02, 0.02 / math.sqrt(2 * n_layers)
        self.heads, self.hd = heads // MP.tp_size, d // heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = ColumnLinear(d, 3 * d, std)
        self.dense = RowLinear(d, d, out_std)
        self.h_to_4h = ColumnLinear(d, 4 * d, std)
        self.h4_to_h = RowLinear(4 * d, d, out_std)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, self.heads, 3 * self.hd).split(self.hd, -1)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.dense(a.transpose(1, 2).reshape(B, T, -1))
        return x + self.h4_to_h(F.gelu(self.h_to_4h(self.ln2(x)), approximate="tanh"))


class GPTModel(nn.Module):
    def __init__(self, vocab, d, heads, n_layers, seq):
        super().__init__()
        self.embed = VocabEmbedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        nn.init.normal_(self.pos.weight, std=0.02)
        self.layers = nn.ModuleList(Layer(d, heads, n_layers) for _ in range(n_layers))
        self.final_ln = nn.LayerNorm(d)

    def forward(self, ids, labels):
        h = self.embed(ids) + self.pos(torch.arange(ids.size(1), device=ids.device))
        for layer in self.layers:
            h = layer(h)
        logits = F.linear(_Copy.apply(self.final_ln(h)), self.embed.weight)  # tied, vocab-parallel
        return _ParallelXent.apply(logits, labels, self.embed.lo, self.embed.hi).mean()


class BinTokens(Dataset):
    def __init__(self, path, seq):
        self.arr = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq = seq

    def __len__(self):
        return (len(self.arr) - 1) // self.seq

    def __getitem__(self, i):
        x = torch.from_numpy(self.arr[i * self.seq:(i + 1) * self.seq + 1].astype(np.int64))
        return x[:-1], x[1:]


@torch.no_grad()
def clip_grad_norm_mp(params, max_norm):
    local = torch.zeros((), device="cuda")
    for p in params:
        if p.grad is not None and (getattr(p, "model_parallel", False) or MP.tp_rank == 0):
            local += p.grad.float().norm() ** 2
    dist.all_reduce(local, group=MP.tp_group)
    total = local.sqrt()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale)
    return total.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--save", default="ckpt/gpt")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--min-lr", type=float, default=2e-5)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--train-iters", type=int, default=100000)
    ap.add_argument("--save-interval", type=int, default=2000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    initialize_model_parallel(args.tp)
    torch.manual_seed(1234)
    accum = args.global_batch // (args.micro_batch * MP.dp_size)
    assert accum * args.micro_batch * MP.dp_size == args.global_batch

    model = GPTModel(args.vocab, args.hidden, args.heads, args.layers, args.seq).cuda()
    params = list(model.parameters())
    ddp = DDP(model, device_ids=[local_rank], process_group=MP.dp_group)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def lr_at(it):
        if it < args.warmup:
            return args.lr * it / args.warmup
        r = (it - args.warmup) / max(1, args.train_iters - args.warmup)
        return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(r, 1.0)))

    it, epoch = 0, 0
    shard = os.path.join(args.save, "latest", f"mp_rank_{MP.tp_rank:02d}.pt")
    if os.path.exists(shard):
        sd = torch.load(shard, map_location=f"cuda:{local_rank}")
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
        it, epoch = sd["iteration"], sd["epoch"]
        if dist.get_rank() == 0:
            print(f"resumed at iteration {it}", flush=True)

    ds = BinTokens(args.data, args.seq)
    sampler = DistributedSampler(ds, num_replicas=MP.dp_size, rank=MP.dp_rank, shuffle=True, seed=1234)
    loader = DataLoader(ds, batch_size=args.micro_batch, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    while it < args.train_iters:
        sampler.set_epoch(epoch)
        data = iter(loader)
        for _ in range(len(loader) // accum):
            for g in opt.param_groups:
                g["lr"] = lr_at(it)
            loss_acc = torch.zeros((), device="cuda")
            for m in range(accum):
                x, y = next(data)
                x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
                # DP gradient all-reduce only on the last micro-batch
                ctx = ddp.no_sync() if m < accum - 1 else contextlib.nullcontext()
                with ctx:
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = ddp(x, y) / accum
                    loss.backward()
                loss_acc += loss.detach()
            gn = clip_grad_norm_mp(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            it += 1

            if it % 10 == 0:
                dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG, group=MP.dp_group)
                if dist.get_rank() == 0:
                    print(f"iter {it} lm_loss {loss_acc.item():.4f} grad_norm {gn:.3f} lr {lr_at(it):.3e}", flush=True)
            if it % args.save_interval == 0:
                if MP.dp_rank == 0:
                    os.makedirs(os.path.dirname(shard), exist_ok=True)
                    tmp = shard + ".tmp"
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                "iteration": it, "epoch": epoch}, tmp)
                    os.replace(tmp, shard)
                dist.barrier()
            if it >= args.train_iters:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
