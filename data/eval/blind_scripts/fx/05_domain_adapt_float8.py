"""Domain-adaptive training of a 3B Llama on medical text.

- 2D mesh: ("dp_shard", "tp"), FSDP2 + TP via DTensor
- float8 (torchao, tensorwise scaling) for the transformer linears
- torch.compile per TransformerBlock, activation checkpointing on every block
- async DCP checkpoints; --export writes a consolidated .pt for the eval harness

    torchrun --standalone --nproc_per_node=8 domain_adapt.py \
        --init-from /nfs/runs/llama3b-general/consolidated.pt --data /nfs/data/pubmed_tok --tp 2 --float8
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
from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as ptd_checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, DistributedSampler

DIM, N_LAYERS, N_HEADS, N_KV, FFN, VOCAB = 3072, 28, 24, 8, 8192, 128256


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def freqs(head_dim, n, theta=500000.0):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    a = torch.outer(torch.arange(n).float(), inv)
    return torch.polar(torch.ones_like(a), a)


def rot(x, f):
    c = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * f[: x.shape[1], None, :]
    return torch.view_as_real(c).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.hd = DIM // N_HEADS
        self.wq = nn.Linear(DIM, N_HEADS * self.hd, bias=False)
        self.wk = nn.Linear(DIM, N_KV * self.hd, bias=False)
        self.wv = nn.Linear(DIM, N_KV * self.hd, bias=False)
        self.wo = nn.Linear(N_HEADS * self.hd, DIM, bias=False)

    def forward(self, x, f):
        b, t, _ = x.shape
        q = rot(self.wq(x).view(b, t, -1, self.hd), f).transpose(1, 2)
        k = rot(self.wk(x).view(b, t, -1, self.hd), f).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(DIM), Attention()
        self.ffn_norm, self.feed_forward = RMSNorm(DIM), FeedForward()

    def forward(self, x, f):
        x = x + self.attention(self.attention_norm(x), f)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, max_len):
        super().__init__()
        self.max_len = max_len
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(N_LAYERS)})
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("freqs_cis", freqs(DIM // N_HEADS, max_len), persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for blk in self.layers.values():
            h = blk(h, self.freqs_cis)
        return self.output(self.norm(h))


class PackedTokens(Dataset):
    def __init__(self, path, seq_len):
        self.arr = np.load(path, mmap_mode="r")  # [N, seq_len + 1] int32
        assert self.arr.shape[1] == seq_len + 1

    def __len__(self):
        return self.arr.shape[0]

    def __getitem__(self, i):
        row = torch.from_numpy(np.asarray(self.arr[i], dtype=np.int64))
        return row[:-1], row[1:]


def parallelize(model, mesh, use_float8):
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp_shard"]
    if use_float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel as Col,
            Float8RowwiseParallel as Row,
            PrepareFloat8ModuleInput as Prep,
        )
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                                   module_filter_fn=lambda m, fqn: "layers." in fqn)
    else:
        from torch.distributed.tensor.parallel import PrepareModuleInput as Prep
        Col, Row = ColwiseParallel, RowwiseParallel

    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for name, blk in model.layers.named_children():
        parallelize_module(blk, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": Prep(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": Col(), "attention.wk": Col(), "attention.wv": Col(),
            "attention.wo": Row(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": Prep(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": Col(), "feed_forward.w3": Col(),
            "feed_forward.w2": Row(output_layouts=Shard(1)),
        })
        blk = ptd_checkpoint_wrapper(blk, preserve_rng_state=False)
        model.layers.register_module(name, torch.compile(blk, fullgraph=True))

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.layers.values():
        fully_shard(blk, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init-from", required=True, help="consolidated.pt, e.g. from --export of an earlier run")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="/nfs/runs/llama3b-med")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--steps", type=int, default=8000)
    ap.add_argument("--save-every", type=int, default=500)
    ap.add_argument("--float8", action="store_true")
    ap.add_argument("--export", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("cpu:gloo,cuda:nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world // args.tp, args.tp), mesh_dim_names=("dp_shard", "tp"))

    with torch.device("meta"):
        model = Transformer(args.seq_len)
    parallelize(model, mesh, args.float8)
    model.to_empty(device="cuda")
    model.freqs_cis = freqs(DIM // N_HEADS, args.seq_len).cuda()

    full_sd = torch.load(args.init_from, weights_only=True)
    set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True))
    del full_sd
    torch.cuda.empty_cache()

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05, foreach=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.05,
                                                anneal_strategy="cos", cycle_momentum=False)

    dp = mesh["dp_shard"]
    ds = PackedTokens(os.path.join(args.data, "train.npy"), args.seq_len)
    sampler = DistributedSampler(ds, num_replicas=dp.size(), rank=dp.get_local_rank(), seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    if args.float8:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    step, epoch, fut = 0, 0, None
    t_last = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if args.float8:
                precompute_float8_dynamic_scale_for_fsdp(model)
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1

            if step % 10 == 0:
                rep = torch.stack([loss.detach().float(), norm.full_tensor().float()])
                dist.all_reduce(rep, op=dist.ReduceOp.AVG, group=dp.get_group())
                if rank == 0:
                    now = time.time()
                    print(f"step {step} loss {rep[0]:.4f} gnorm {rep[1]:.3f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(now - t_last) / 10:.2f}s/step", flush=True)
                    t_last = now

            if step % args.save_every == 0:
                if fut is not None:
                    fut.result()
                msd, osd = get_state_dict(model, opt)
                fut = dcp.async_save({"model": msd, "optim": osd, "step": step},
                                     checkpoint_id=f"{args.out}/dcp/step{step}")
            if step >= args.steps:
                break
        epoch += 1

    if fut is not None:
        fut.result()

    if args.export:
        # gathered on every rank (collective), written once
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        if rank == 0:
            torch.save(full, f"{args.out}/consolidated.pt")
        del full
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
