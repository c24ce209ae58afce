#!/usr/bin/env python
"""Llama-style pretraining: FSDP2 (dp_shard) x TP on a 2D device mesh.

float8 linears (torchao) with float8 all-gather for FSDP and float8 TP styles,
per-block torch.compile, full activation checkpointing, async DCP checkpoints.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$MASTER_ADDR:29500 train_llama_2d.py --tp 8 \
        --data /lustre/datasets/fineweb-edu/tokens --ckpt-dir /lustre/ckpt/llama-3b
"""
import argparse
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp
from torchao.float8.float8_tensor_parallel import (
    Float8ColwiseParallel,
    Float8RowwiseParallel,
    PrepareFloat8ModuleInput,
)

logger = logging.getLogger("train")


@dataclass
class ModelArgs:
    dim: int = 3072
    n_layers: int = 26
    n_heads: int = 24
    n_kv_heads: int = 8
    vocab_size: int = 128256
    ffn_hidden: int = 8192
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 4096


def precompute_freqs_cis(dim, end, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, device=freqs.device)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs).float())


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[: xq_.shape[1]].view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight

    def reset_parameters(self):
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.head_dim = a.dim // a.n_heads
        self.n_rep = a.n_heads // a.n_kv_heads
        self.wq = nn.Linear(a.dim, a.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * self.head_dim, a.dim, bias=False)

    def init_weights(self, std):
        for lin in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(lin.weight, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, std=std)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        # -1 for the head dim: under TP each rank only holds its local heads
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rotary_emb(q, k, freqs_cis)
        k = k.repeat_interleave(self.n_rep, dim=2)
        v = v.repeat_interleave(self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def init_weights(self, std):
        nn.init.trunc_normal_(self.w1.weight, std=0.02)
        nn.init.trunc_normal_(self.w2.weight, std=std)
        nn.init.trunc_normal_(self.w3.weight, std=std)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id, a: ModelArgs):
        super().__init__()
        self.attention = Attention(a)
        self.feed_forward = FeedForward(a.dim, a.ffn_hidden)
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def init_weights(self):
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        self.feed_forward.init_weights(self.init_std)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, a) for i in range(a.n_layers)})
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(a.dim // a.n_heads, a.max_seq_len * 2, a.rope_theta), persistent=False)

    @torch.no_grad()
    def init_weights(self, buffer_device):
        with torch.device(buffer_device):
            self.freqs_cis = precompute_freqs_cis(self.args.dim // self.args.n_heads, self.args.max_seq_len * 2, self.args.rope_theta)
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        std = self.args.dim ** -0.5
        nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


class TokenShards(Dataset):
    def __init__(self, path, seq_len):
        self.tokens = np.memmap(path, dtype=np.uint32, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i):
        s = i * self.seq_len
        x = torch.from_numpy(self.tokens[s : s + self.seq_len + 1].astype(np.int64))
        return x[:-1], x[1:]


class TrainState(Stateful):
    def __init__(self, model, optimizer, scheduler):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.step = 0

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "sched": self.scheduler.state_dict(), "step": torch.tensor(self.step)}

    def load_state_dict(self, sd):
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.scheduler.load_state_dict(sd["sched"])
        self.step = int(sd["step"])


def parallelize(model, mesh, args):
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    if args.float8:
        cfg = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        # lm head stays in bf16
        convert_to_float8_training(model, config=cfg, module_filter_fn=lambda mod, fqn: fqn != "output")
        colwise, rowwise, prep_in = Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    else:
        from torch.distributed.tensor.parallel import PrepareModuleInput
        colwise, rowwise, prep_in = ColwiseParallel, RowwiseParallel, PrepareModuleInput

    if tp_mesh.size() > 1:
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True),
        })
        for block in model.layers.values():
            parallelize_module(block, tp_mesh, {
                "attention_norm": SequenceParallel(),
                "attention": prep_in(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
                "attention.wq": colwise(),
                "attention.wk": colwise(),
                "attention.wv": colwise(),
                "attention.wo": rowwise(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": prep_in(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": colwise(),
                "feed_forward.w2": rowwise(output_layouts=Shard(1)),
                "feed_forward.w3": colwise(),
            })

    for layer_id, block in model.layers.named_children():
        block = checkpoint_wrapper(block, preserve_rng_state=False)
        block = torch.compile(block, fullgraph=True)
        model.layers.register_module(layer_id, block)

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    n = len(model.layers)
    for i, block in enumerate(model.layers.values()):
        # the last block is all-gathered again right away for backward
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=i < n - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=True)
    return model


def latest_checkpoint(ckpt_dir):
    if not os.path.isdir(ckpt_dir):
        return None
    # .metadata is written last, so a directory without it is an interrupted save
    steps = [int(d.split("-")[1]) for d in os.listdir(ckpt_dir)
             if d.startswith("step-") and os.path.exists(os.path.join(ckpt_dir, d, ".metadata"))]
    return os.path.join(ckpt_dir, f"step-{max(steps)}") if steps else None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--local-batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--ckpt-every", type=int, default=500)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--float8", action="store_true")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # gloo for the CPU-side collectives of async checkpointing, nccl for everything else
    dist.init_process_group(backend="cpu:gloo,cuda:nccl")
    world = dist.get_world_size()
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    assert world % args.tp == 0
    mesh = init_device_mesh("cuda", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_mesh = mesh["dp"]
    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
    torch.manual_seed(1234)

    margs = ModelArgs(max_seq_len=args.seq_len)
    with torch.device("meta"):
        model = Transformer(margs)
    model = parallelize(model, mesh, args)
    model.to_empty(device="cuda")
    model.init_weights(buffer_device="cuda")
    model.train()

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def lr_lambda(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        prog = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    state = TrainState(model, optimizer, scheduler)

    resume = latest_checkpoint(args.ckpt_dir)
    if resume is not None:
        dcp.load({"train": state}, checkpoint_id=resume)
        logger.info("resumed from %s at step %d", resume, state.step)

    # TP peers share dp_rank, so they see identical token blocks
    ds = TokenShards(os.path.join(args.data, "train.bin"), args.seq_len)
    sampler = DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=1234, drop_last=True)
    loader = DataLoader(ds, batch_size=args.local_batch, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    epoch = state.step // len(loader)
    sampler.set_epoch(epoch)
    it = iter(loader)
    ckpt_future = None
    t0 = time.perf_counter()

    while state.step < args.steps:
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            it = iter(loader)
            x, y = next(it)
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)

        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        if args.float8:
            precompute_float8_dynamic_scale_for_fsdp(model)
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        state.step += 1

        if state.step % args.log_every == 0:
            avg = loss.detach().clone()
            dist.all_reduce(avg, op=dist.ReduceOp.AVG, group=dp_mesh.get_group())
            if isinstance(grad_norm, DTensor):
                grad_norm = grad_norm.full_tensor()
            dt = time.perf_counter() - t0
            tok_s = args.log_every * args.local_batch * args.seq_len * dp_size / dt
            if rank == 0:
                logger.info("step %d loss %.4f gnorm %.3f lr %.2e tok/s %.0f mem %.1fGiB",
                            state.step, avg.item(), grad_norm.item(), scheduler.get_last_lr()[0], tok_s,
                            torch.cuda.max_memory_allocated() / 2**30)
            t0 = time.perf_counter()

        if state.step % args.ckpt_every == 0 or state.step == args.steps:
            if ckpt_future is not None:
                ckpt_future.result()
            ckpt_future = dcp.async_save({"train": state},
                                         checkpoint_id=os.path.join(args.ckpt_dir, f"step-{state.step}"))

    if ckpt_future is not None:
        ckpt_future.result()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
