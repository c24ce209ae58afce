"""Llama pretraining: pipeline (GPipe) x FSDP2 x TP with sequence parallelism.

The loss only exists on the last pipeline stage, so metrics are logged from there.

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500 \
        llama_sp_train.py --pp 2 --tp 4 --wandb-project llama-3d
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
import wandb
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(end).float(), freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rope(x, freqs_cis):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, freqs_cis):
        b, s, _ = x.shape
        q = apply_rope(self.wq(x).view(b, s, -1, self.head_dim), freqs_cis)
        k = apply_rope(self.wk(x).view(b, s, -1, self.head_dim), freqs_cis)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim, n_heads, hidden):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, vocab, dim, n_layers, n_heads, hidden, max_seq):
        super().__init__()
        self.dim, self.n_heads, self.max_seq = dim, n_heads, max_seq
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // n_heads, max_seq), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, n_heads, hidden) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def pipeline_split(model, stage, n_stages):
    n = len(model.layers) // n_stages
    for k in list(model.layers.keys()):
        if not stage * n <= int(k) < (stage + 1) * n:
            del model.layers[k]
    if stage != 0:
        model.tok_embeddings = None
    if stage != n_stages - 1:
        model.norm, model.output = None, None


def apply_tp_sp(model, tp_mesh):
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.output is not None:
        top["norm"] = SequenceParallel()
        top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    if top:
        parallelize_module(model, tp_mesh, top)
    for blk in model.layers.values():
        parallelize_module(blk, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                            desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })


class Tokens(Dataset):
    def __init__(self, path, seq_len):
        self.t = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.t) - 1) // self.seq_len

    def __getitem__(self, i):
        c = torch.from_numpy(self.t[i * self.seq_len: (i + 1) * self.seq_len + 1].astype(np.int64))
        return c[:-1], c[1:]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/scratch/shared/fineweb10B/train.bin")
    p.add_argument("--ckpt", default="/scratch/shared/ckpt/llama_sp")
    p.add_argument("--wandb-project", default="llama-3d")
    p.add_argument("--run-name", default=None)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--hidden", type=int, default=5632)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--steps", type=int, default=80_000)
    p.add_argument("--save-every", type=int, default=2000)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dp = int(os.environ["WORLD_SIZE"]) // (args.pp * args.tp)
    mesh = init_device_mesh("cuda", (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    is_first, is_last = pp_rank == 0, pp_rank == args.pp - 1
    assert args.seq % args.tp == 0 and args.layers % args.pp == 0

    if is_last:
        wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(50304, args.dim, args.layers, args.heads, args.hidden, args.seq)
    pipeline_split(model, pp_rank, args.pp)
    apply_tp_sp(model, mesh["tp"])
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.layers.values():
        fully_shard(blk, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    model.to_empty(device=device)
    with torch.no_grad():
        model.freqs_cis.copy_(precompute_freqs_cis(args.dim // args.heads, args.seq))
        for n, w in model.named_parameters():
            if "norm" in n:
                w.fill_(1.0)
            else:
                nn.init.trunc_normal_(w, std=0.02)

    stage = PipelineStage(model, pp_rank, args.pp, device, group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=args.micro,
                             loss_fn=lambda o, t: F.cross_entropy(o.flatten(0, 1).float(), t.flatten(0, 1)))

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * max(0.1, 0.5 * (1 + math.cos(math.pi * s / args.steps))))

    ds = Tokens(args.data, args.seq)
    sampler = DistributedSampler(ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    step = 0
    if os.path.exists(os.path.join(args.ckpt, ".metadata")):
        m, o = get_state_dict(model, opt)
        sd = {"model": m, "optim": o, "step": 0}
        dcp.load(sd, checkpoint_id=args.ckpt)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        step = sd["step"]
        sched.last_epoch = step - 1
        sched.step()

    epoch = step // len(loader)
    sampler.set_epoch(epoch)
    it = iter(loader)
    tick = time.time()
    while step < args.steps:
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            it = iter(loader)
            x, y = next(it)
        opt.zero_grad(set_to_none=True)
        losses = [] if is_last else None
        if is_first:
            schedule.step(x.to(device, non_blocking=True))
        elif is_last:
            schedule.step(target=y.to(device, non_blocking=True), losses=losses)
        else:
            schedule.step()
        opt.step()
        sched.step()
        step += 1

        if is_last and step % 10 == 0:
            loss = torch.stack(losses).mean().detach()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
            elapsed = time.time() - tick
            wandb.log({"loss": loss.item(), "lr": sched.get_last_lr()[0],
                       "tok_per_sec": 10 * args.batch * dp * args.seq / elapsed, "epoch": epoch}, step=step)
            tick = time.time()

        if step % args.save_every == 0:
            m, o = get_state_dict(model, opt)
            dcp.save({"model": m, "optim": o, "step": step}, checkpoint_id=args.ckpt)

    if is_last:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
