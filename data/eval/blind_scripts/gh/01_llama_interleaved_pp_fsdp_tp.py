#!/usr/bin/env python
"""Llama-style pretraining with interleaved 1F1B pipeline x FSDP2 x TP.

Mesh layout is (pp, dp, tp), tp innermost so TP collectives stay on NVLink.
Each pp rank owns `--stages-per-rank` virtual stages (stage i lives on pp rank i % pp).

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \
        train_interleaved.py --pp 4 --tp 2 --stages-per-rank 2 --data /lustre/tok/fineweb_edu
"""
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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, DistributedSampler


@dataclass
class ModelArgs:
    dim: int = 2048
    n_layers: int = 24
    n_heads: int = 16
    vocab_size: int = 50304
    ffn_hidden: int = 5632
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048


def precompute_freqs_cis(dim, end, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x, freqs_cis):
        bsz, seqlen, _ = x.shape
        # -1 picks up the local number of heads when wq/wk/wv are column-sharded
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rotary_emb(q, k, freqs_cis)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # ModuleDict keeps the global layer index in the FQN, so checkpoints don't depend on the pp split
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len, args.rope_theta),
            persistent=False,
        )

    @torch.no_grad()
    def init_weights(self):
        self.freqs_cis.copy_(
            precompute_freqs_cis(self.args.dim // self.args.n_heads, self.args.max_seq_len, self.args.rope_theta)
        )
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        std = 0.02 / math.sqrt(2 * self.args.n_layers)
        for block in self.layers.values():
            for name, p in block.named_parameters():
                if p.dim() == 2:
                    nn.init.trunc_normal_(p, std=0.02 if name.endswith(("wq.weight", "w1.weight")) else std)
                else:
                    nn.init.ones_(p)
        if self.norm is not None:
            nn.init.ones_(self.norm.weight)
        if self.output is not None:
            nn.init.trunc_normal_(self.output.weight, std=self.args.dim ** -0.5)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def build_stage_model(margs, stage_idx, num_stages):
    with torch.device("meta"):
        model = Transformer(margs)
    per_stage = margs.n_layers // num_stages
    lo, hi = stage_idx * per_stage, (stage_idx + 1) * per_stage
    for key in list(model.layers.keys()):
        if not lo <= int(key) < hi:
            del model.layers[key]
    if stage_idx != 0:
        model.tok_embeddings = None
    if stage_idx != num_stages - 1:
        model.norm = None
        model.output = None
    return model


def parallelize(model, tp_mesh, dp_mesh):
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    if model.output is not None:
        top["output"] = ColwiseParallel(output_layouts=Replicate())
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        })
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # no reshard after forward: with PP the same params are used by many microbatches in a row
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    return model


class TokenWindows(Dataset):
    def __init__(self, path, seq_len):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, idx):
        start = idx * self.seq_len
        buf = torch.from_numpy(self.tokens[start: start + self.seq_len + 1].astype(np.int64))
        return buf[:-1], buf[1:]


class ModelParts(Stateful):
    def __init__(self, parts):
        self.parts = parts

    def state_dict(self):
        return {k: v for p in self.parts for k, v in get_model_state_dict(p).items()}

    def load_state_dict(self, sd):
        for p in self.parts:
            set_model_state_dict(p, sd, options=StateDictOptions(strict=False))


class OptimParts(Stateful):
    def __init__(self, parts, optims):
        self.parts, self.optims = parts, optims
        self.opts = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self):
        out = {}
        for p, o in zip(self.parts, self.optims):
            out.update(get_optimizer_state_dict(p, o, options=self.opts))
        return out

    def load_state_dict(self, sd):
        for p, o in zip(self.parts, self.optims):
            set_optimizer_state_dict(p, o, optim_state_dict=sd, options=self.opts)


@torch.no_grad()
def clip_grad_norm_(parts, max_norm, pp_group):
    grads = [p.grad for m in parts for p in m.parameters() if p.grad is not None]
    sq = torch.zeros((), device=grads[0].device, dtype=torch.float32)
    for g in grads:
        n = torch.linalg.vector_norm(g)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        sq += n * n
    # each pp rank only has its own stages' grads
    dist.all_reduce(sq, group=pp_group)
    total = sq.sqrt().item()
    coef = min(1.0, max_norm / (total + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--ckpt-dir", default="/lustre/ckpt/llama2b_interleaved")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--stages-per-rank", type=int, default=2)
    ap.add_argument("--local-batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--save-every", type=int, default=1000)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    world = int(os.environ["WORLD_SIZE"])
    dp = world // (args.pp * args.tp)
    mesh = init_device_mesh("cuda", (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_mesh, dp_mesh, tp_mesh = mesh["pp"], mesh["dp"], mesh["tp"]
    pp_rank, dp_rank = pp_mesh.get_local_rank(), dp_mesh.get_local_rank()
    rank = dist.get_rank()
    torch.manual_seed(args.seed)

    margs = ModelArgs(max_seq_len=args.seq_len)
    num_stages = args.pp * args.stages_per_rank
    assert margs.n_layers % num_stages == 0
    stage_ids = [pp_rank + i * args.pp for i in range(args.stages_per_rank)]
    parts, stages = [], []
    for sid in stage_ids:
        m = parallelize(build_stage_model(margs, sid, num_stages), tp_mesh, dp_mesh)
        m.to_empty(device=device)
        m.init_weights()
        parts.append(m)
        stages.append(PipelineStage(m, sid, num_stages, device, group=pp_mesh.get_group()))
    has_first = 0 in stage_ids
    has_last = (num_stages - 1) in stage_ids

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))

    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=args.microbatches, loss_fn=loss_fn)

    optims = [torch.optim.AdamW(m.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1) for m in parts]

    def lr_lambda(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        prog = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(prog, 1.0)))

    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda) for o in optims]

    ds = TokenWindows(os.path.join(args.data, "train.bin"), args.seq_len)
    sampler = DistributedSampler(ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=args.local_batch, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    step_t = torch.zeros((), dtype=torch.int64)
    state = {"model": ModelParts(parts), "optim": OptimParts(parts, optims), "step": step_t}
    latest = os.path.join(args.ckpt_dir, "latest")
    if os.path.isdir(latest):
        dcp.load(state, checkpoint_id=latest)
        for s in scheds:
            s.last_epoch = int(step_t) - 1
            s.step()
        if rank == 0:
            print(f"resumed from step {int(step_t)}", flush=True)
    step = int(step_t)

    epoch = step // len(loader)
    sampler.set_epoch(epoch)
    it = iter(loader)
    for _ in range(step % len(loader)):
        next(it)
    t0 = time.perf_counter()
    while step < args.steps:
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            it = iter(loader)
            x, y = next(it)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)

        for o in optims:
            o.zero_grad(set_to_none=True)
        losses = [] if has_last else None
        if has_first:
            schedule.step(x, target=y if has_last else None, losses=losses)
        else:
            schedule.step(target=y if has_last else None, losses=losses)

        gnorm = clip_grad_norm_(parts, 1.0, pp_mesh.get_group())
        for o, s in zip(optims, scheds):
            o.step()
            s.step()
        step += 1

        if step % args.log_every == 0:
            loss = torch.stack(losses).mean().detach() if has_last else torch.tensor(-1.0, device=device)
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=dp_mesh.get_group())
            dist.all_reduce(loss, op=dist.ReduceOp.MAX, group=pp_mesh.get_group())
            if rank == 0:
                dt = (time.perf_counter() - t0) / args.log_every
                tok_s = args.local_batch * dp * args.seq_len / dt
                print(f"step {step} loss {loss.item():.4f} gnorm {gnorm:.2f} "
                      f"lr {scheds[0].get_last_lr()[0]:.2e} tok/s {tok_s:,.0f}", flush=True)
            t0 = time.perf_counter()

        if step % args.save_every == 0 or step == args.steps:
            step_t.fill_(step)
            path = os.path.join(args.ckpt_dir, f"step_{step:07d}")
            dcp.save(state, checkpoint_id=path)
            dist.barrier()
            if rank == 0:
                tmp = latest + ".tmp"
                if os.path.lexists(tmp):
                    os.remove(tmp)
                os.symlink(os.path.basename(path), tmp)
                os.replace(tmp, latest)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
