#!/usr/bin/env python
# Llama-70B-shaped pretraining: pipeline (1F1B) x FSDP2 x TP on 8 nodes x 8 H100.
#
#   srun -N 8 --ntasks-per-node=1 torchrun --nnodes 8 --nproc_per_node 8 --rdzv_backend c10d \
#       --rdzv_endpoint $MASTER_ADDR:29500 train_70b.py --pp 4 --tp 8
import argparse
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, DistributedSampler


@dataclass
class Llama70B:
    dim: int = 8192
    n_layers: int = 80
    n_heads: int = 64
    n_kv_heads: int = 8
    ffn_dim: int = 28672
    vocab_size: int = 128256
    rope_theta: float = 500000.0
    eps: float = 1e-5


def rope(x, theta):
    s, d = x.shape[1], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device).float() / d))
    f = torch.outer(torch.arange(s, device=x.device).float(), inv)
    c = torch.polar(torch.ones_like(f), f)[None, :, None, :]
    return torch.view_as_real(torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * c).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, c: Llama70B):
        super().__init__()
        self.c, self.hd, self.rep = c, c.dim // c.n_heads, c.n_heads // c.n_kv_heads
        self.wq = nn.Linear(c.dim, c.n_heads * self.hd, bias=False)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(c.n_heads * self.hd, c.dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = rope(self.wq(x).view(b, s, -1, self.hd), self.c.rope_theta).transpose(1, 2)
        k = rope(self.wk(x).view(b, s, -1, self.hd), self.c.rope_theta).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.hd).transpose(1, 2)
        k, v = k.repeat_interleave(self.rep, 1), v.repeat_interleave(self.rep, 1)
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.w2 = nn.Linear(c.ffn_dim, c.dim, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(c.dim, eps=c.eps), Attention(c)
        self.ffn_norm, self.feed_forward = nn.RMSNorm(c.dim, eps=c.eps), FeedForward(c)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, c: Llama70B):
        super().__init__()
        self.c = c
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(c) for i in range(c.n_layers)})
        self.norm = nn.RMSNorm(c.dim, eps=c.eps)
        self.output = nn.Linear(c.dim, c.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self):
        nn.init.normal_(self.tok_embeddings.weight, std=1.0)
        out_std = 0.02 / math.sqrt(2 * self.c.n_layers)
        for blk in self.layers.values():
            for lin in (blk.attention.wq, blk.attention.wk, blk.attention.wv, blk.feed_forward.w1, blk.feed_forward.w3):
                nn.init.trunc_normal_(lin.weight, std=0.02)
            for lin in (blk.attention.wo, blk.feed_forward.w2):
                nn.init.trunc_normal_(lin.weight, std=out_std)
        nn.init.trunc_normal_(self.output.weight, std=self.c.dim ** -0.5)

    def forward(self, h):
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for blk in self.layers.values():
            h = blk(h)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h


def build_stage_model(cfg, pp_rank, pp, device, seed):
    torch.manual_seed(seed)
    # initialize on the GPU: CPU init of a model this size takes forever
    with torch.device(device):
        model = Transformer(cfg)
    model.init_weights()
    per = cfg.n_layers // pp
    for k in list(model.layers.keys()):
        if not pp_rank * per <= int(k) < (pp_rank + 1) * per:
            del model.layers[k]
    if pp_rank != 0:
        model.tok_embeddings = None
    if pp_rank != pp - 1:
        model.norm = model.output = None
    torch.cuda.empty_cache()
    return model


def apply_parallelism(model, mesh):
    tp = mesh["tp"]
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    if model.output is not None:
        top["output"] = ColwiseParallel(output_layouts=Replicate())
    if top:
        parallelize_module(model, tp, top)
    for blk in model.layers.values():
        parallelize_module(blk, tp, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        })
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.layers.values():
        fully_shard(blk, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)


class Tokens(Dataset):
    def __init__(self, path, seq):
        self.t, self.seq = np.memmap(path, dtype=np.uint32, mode="r"), seq

    def __len__(self):
        return (len(self.t) - 1) // self.seq

    def __getitem__(self, i):
        w = torch.from_numpy(self.t[i * self.seq:(i + 1) * self.seq + 1].astype(np.int64))
        return w[:-1], w[1:]


class State(Stateful):
    def __init__(self, model, opt):
        self.model, self.opt, self.step = model, opt, 0

    def state_dict(self):
        m, o = get_state_dict(self.model, self.opt)
        return {"model": m, "optim": o, "step": self.step}

    def load_state_dict(self, sd):
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.step = sd["step"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/lustre/data/llama3_mix/train.u32")
    ap.add_argument("--ckpt-dir", default="/lustre/ckpt/llama70b_pt")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--local-batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1.5e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=200_000)
    ap.add_argument("--save-every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dp = int(os.environ["WORLD_SIZE"]) // (args.pp * args.tp)
    mesh = init_device_mesh("cuda", (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    rank = dist.get_rank()
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    first, last = pp_rank == 0, pp_rank == args.pp - 1

    cfg = Llama70B()
    model = build_stage_model(cfg, pp_rank, args.pp, device, args.seed)
    apply_parallelism(model, mesh)
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"stage 0 params: {n / 1e9:.2f}B (dp={dp})", flush=True)

    stage = PipelineStage(model, pp_rank, args.pp, device, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, args.microbatches,
                            loss_fn=lambda o, t: F.cross_entropy(o.flatten(0, 1).float(), t.flatten(0, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup) * max(
        0.1, 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))

    ds = Tokens(args.data, args.seq)
    sampler = DistributedSampler(ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=args.local_batch, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    state = State(model, opt)
    latest = os.path.join(args.ckpt_dir, "latest")
    if os.path.exists(os.path.join(latest, ".metadata")):
        dcp.load({"state": state}, checkpoint_id=latest)
        sched.last_epoch = state.step - 1
        sched.step()

    epoch = state.step // len(loader)
    sampler.set_epoch(epoch)
    it = iter(loader)
    t0 = time.time()
    while state.step < args.steps:
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            it = iter(loader)
            x, y = next(it)
        opt.zero_grad(set_to_none=True)
        losses = [] if last else None
        if first:
            schedule.step(x.to(device, non_blocking=True))
        elif last:
            schedule.step(target=y.to(device, non_blocking=True), losses=losses)
        else:
            schedule.step()
        opt.step()
        sched.step()
        state.step += 1

        if state.step % 5 == 0:
            loss = torch.stack(losses).mean().detach() if last else torch.tensor(-1.0, device=device)
            dist.all_reduce(loss, op=dist.ReduceOp.MAX, group=mesh["pp"].get_group())
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
            if rank == 0:
                print(f"step {state.step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / 5:.1f}s/it", flush=True)
            t0 = time.time()

        if state.step % args.save_every == 0:
            dcp.save({"state": state}, checkpoint_id=latest)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
