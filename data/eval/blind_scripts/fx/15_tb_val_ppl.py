"""Llama-3-style 1B run with TensorBoard logging of train loss and held-out perplexity.

FSDP2 (dp) x TP (tp) on a 2D device mesh, bf16 mixed precision, per-block compile,
activation checkpointing, async distributed checkpoints every N steps.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        train_tb.py --data /shared/tok/slimpajama --logdir /shared/tb/l1b --ckpt /shared/ckpt/l1b --tp 2
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter


class Windows(Dataset):
    def __init__(self, path, seq_len):
        self.d = np.memmap(path, dtype=np.uint32, mode="r")
        self.s = seq_len

    def __len__(self):
        return (len(self.d) - 1) // self.s

    def __getitem__(self, i):
        a = torch.from_numpy(self.d[i * self.s: i * self.s + self.s + 1].astype(np.int64))
        return a[:-1], a[1:]


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_cache(hd, n, theta=500000.0):
    a = torch.outer(torch.arange(n).float(), theta ** (-torch.arange(0, hd, 2).float() / hd))
    return torch.polar(torch.ones_like(a), a)


def rope(x, c):
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * c[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, d, nh, nkv):
        super().__init__()
        self.hd = d // nh
        self.wq = nn.Linear(d, nh * self.hd, bias=False)
        self.wk = nn.Linear(d, nkv * self.hd, bias=False)
        self.wv = nn.Linear(d, nkv * self.hd, bias=False)
        self.wo = nn.Linear(nh * self.hd, d, bias=False)

    def forward(self, x, c):
        b, t, _ = x.shape
        q = rope(self.wq(x).view(b, t, -1, self.hd), c).transpose(1, 2)
        k = rope(self.wk(x).view(b, t, -1, self.hd), c).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False), nn.Linear(d, f, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, d, nh, nkv, f):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(d), Attention(d, nh, nkv)
        self.ffn_norm, self.feed_forward = RMSNorm(d), FeedForward(d, f)

    def forward(self, x, c):
        x = x + self.attention(self.attention_norm(x), c)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, vocab=128256, d=2048, n_layers=16, nh=32, nkv=8, f=8192, seq_len=4096):
        super().__init__()
        self.hd, self.seq_len = d // nh, seq_len
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(d, nh, nkv, f) for i in range(n_layers)})
        self.norm = RMSNorm(d)
        self.output = nn.Linear(d, vocab, bias=False)
        self.register_buffer("rope_cache", rope_cache(self.hd, seq_len), persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope_cache)
        return self.output(self.norm(h))


def parallelize(model, mesh):
    tp = mesh["tp"]
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for blk in model.layers.values():
        parallelize_module(blk, tp, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    for lid in list(model.layers.keys()):
        model.layers[lid] = torch.compile(checkpoint_wrapper(model.layers[lid], preserve_rng_state=False))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.layers.values():
        fully_shard(blk, mesh=mesh["dp"], mp_policy=mp)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp)


class TrainState(Stateful):
    def __init__(self, model, opt, sched):
        self.model, self.opt, self.sched, self.step = model, opt, sched, 0

    def state_dict(self):
        m, o = get_state_dict(self.model, self.opt)
        return {"model": m, "optim": o, "sched": self.sched.state_dict(), "step": self.step}

    def load_state_dict(self, sd):
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.sched.load_state_dict(sd["sched"])
        self.step = sd["step"]


@torch.no_grad()
def val_loss(model, loader, n_batches):
    model.eval()
    losses = []
    for i, (x, y) in enumerate(loader):
        if i == n_batches:
            break
        logits = model(x.cuda(non_blocking=True))
        losses.append(F.cross_entropy(logits.flatten(0, 1).float(), y.cuda().flatten()))
    model.train()
    return torch.stack(losses).mean().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--logdir", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--steps", type=int, default=50000)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--val-every", type=int, default=500)
    ap.add_argument("--val-batches", type=int, default=40)
    ap.add_argument("--ckpt-every", type=int, default=1000)
    args = ap.parse_args()

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]
    writer = SummaryWriter(args.logdir) if rank == 0 else None

    train_ds = Windows(os.path.join(args.data, "train.bin"), args.seq_len)
    val_ds = Windows(os.path.join(args.data, "validation.bin"), args.seq_len)
    tsamp = DistributedSampler(train_ds, num_replicas=dp.size(), rank=dp.get_local_rank(), seed=0, drop_last=True)
    vsamp = DistributedSampler(val_ds, num_replicas=dp.size(), rank=dp.get_local_rank(), shuffle=False)
    tl = DataLoader(train_ds, batch_size=args.bs, sampler=tsamp, num_workers=4, pin_memory=True, drop_last=True)
    vl = DataLoader(val_ds, batch_size=args.bs, sampler=vsamp, num_workers=2, pin_memory=True)

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(seq_len=args.seq_len)
    parallelize(model, mesh)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                nn.init.trunc_normal_(p, std=0.02)
    model.rope_cache = rope_cache(model.hd, args.seq_len).cuda()

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / args.warmup if s < args.warmup
        else 0.1 + 0.45 * (1 + math.cos(math.pi * (s - args.warmup) / (args.steps - args.warmup))))
    state = TrainState(model, opt, sched)
    done = sorted(d for d in os.listdir(args.ckpt) if os.path.exists(os.path.join(args.ckpt, d, ".metadata"))) \
        if os.path.isdir(args.ckpt) else []
    if done:
        dcp.load({"state": state}, checkpoint_id=os.path.join(args.ckpt, done[-1]))

    epoch = state.step // len(tl)
    tsamp.set_epoch(epoch)
    it = iter(tl)
    fut = None
    t0 = time.time()
    while state.step < args.steps:
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            tsamp.set_epoch(epoch)
            it = iter(tl)
            x, y = next(it)
        loss = F.cross_entropy(model(x.cuda(non_blocking=True)).flatten(0, 1).float(), y.cuda(non_blocking=True).flatten())
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        state.step += 1

        if state.step % 10 == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG, group=dp.get_group())
            if rank == 0:
                dt = (time.time() - t0) / 10
                writer.add_scalar("train/loss", l.item(), state.step)
                writer.add_scalar("train/grad_norm", gn.item(), state.step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], state.step)
                writer.add_scalar("perf/tokens_per_sec", args.bs * args.seq_len * dp.size() / dt, state.step)
            t0 = time.time()

        if state.step % args.val_every == 0:
            vloss = val_loss(model, vl, args.val_batches)
            if rank == 0:
                writer.add_scalar("val/loss", vloss, state.step)
                writer.add_scalar("val/ppl", math.exp(vloss), state.step)
                print(f"step {state.step} val_loss {vloss:.4f} ppl {math.exp(vloss):.2f}", flush=True)

        if state.step % args.ckpt_every == 0:
            if fut is not None:
                fut.result()
            fut = dcp.async_save({"state": state}, checkpoint_id=os.path.join(args.ckpt, f"step{state.step:07d}"))

    if fut is not None:
        fut.result()
    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
