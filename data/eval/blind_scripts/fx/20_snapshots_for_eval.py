"""8B continued pretraining with periodic consolidated snapshots.

An offline evaluation service watches <out>/snapshots/ and picks up every new
consolidated.pt listed in index.json. Resumable state goes to async DCP checkpoints.

FSDP2 x TP (2D DeviceMesh), float8 linears via torchao, compiled blocks, AC.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        cpt_snapshots.py --data /lustre/tok/mix --init /lustre/ckpt/llama8b-dcp --out /lustre/runs/cpt8b
"""
import argparse
import json
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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp
from torchao.float8.float8_tensor_parallel import (
    Float8ColwiseParallel,
    Float8RowwiseParallel,
    PrepareFloat8ModuleInput,
)

DIM, LAYERS, HEADS, KV, HIDDEN, VOCAB = 4096, 32, 32, 8, 14336, 128256


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * self.weight


def rope_freqs(n, hd=DIM // HEADS):
    a = torch.outer(torch.arange(n).float(), 500000.0 ** (-torch.arange(0, hd, 2).float() / hd))
    return torch.polar(torch.ones_like(a), a)


def rope(x, f):
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * f[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.hd = DIM // HEADS
        self.wq = nn.Linear(DIM, HEADS * self.hd, bias=False)
        self.wk = nn.Linear(DIM, KV * self.hd, bias=False)
        self.wv = nn.Linear(DIM, KV * self.hd, bias=False)
        self.wo = nn.Linear(HEADS * self.hd, DIM, bias=False)

    def forward(self, x, f):
        b, t, _ = x.shape
        q = rope(self.wq(x).view(b, t, -1, self.hd), f).transpose(1, 2)
        k = rope(self.wk(x).view(b, t, -1, self.hd), f).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

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
    def __init__(self, seq_len):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(LAYERS)})
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("freqs_cis", rope_freqs(seq_len), persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


class Chunks(Dataset):
    def __init__(self, path, seq_len):
        self.a, self.n = np.memmap(path, dtype=np.uint32, mode="r"), seq_len

    def __len__(self):
        return (len(self.a) - 1) // self.n

    def __getitem__(self, i):
        w = torch.from_numpy(self.a[i * self.n: (i + 1) * self.n + 1].astype(np.int64))
        return w[:-1], w[1:]


def parallelize(model, mesh):
    tp, dp = mesh["tp"], mesh["dp"]
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                               module_filter_fn=lambda mod, fqn: fqn != "output")
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for lid, blk in model.layers.named_children():
        parallelize_module(blk, tp, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareFloat8ModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": Float8ColwiseParallel(),
            "attention.wk": Float8ColwiseParallel(),
            "attention.wv": Float8ColwiseParallel(),
            "attention.wo": Float8RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareFloat8ModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": Float8ColwiseParallel(),
            "feed_forward.w3": Float8ColwiseParallel(),
            "feed_forward.w2": Float8RowwiseParallel(output_layouts=Shard(1)),
        })
        blk = torch.compile(checkpoint_wrapper(blk, preserve_rng_state=False))
        fully_shard(blk, mesh=dp, mp_policy=mp)
        model.layers.register_module(lid, blk)
    fully_shard(model, mesh=dp, mp_policy=mp)


def save_consolidated(model, path):
    """All-gather the full (unsharded) weights and write them as a single file."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(full, path)
    return len(full)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=25000)
    ap.add_argument("--ckpt-every", type=int, default=500)
    ap.add_argument("--snapshot-every", type=int, default=2500)
    args = ap.parse_args()

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]

    with torch.device("meta"):
        model = Transformer(args.seq_len)
    parallelize(model, mesh)
    model.to_empty(device="cuda")
    model.freqs_cis = rope_freqs(args.seq_len).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 500) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))))

    step = 0
    ck_dir = os.path.join(args.out, "dcp")
    done = sorted(d for d in os.listdir(ck_dir) if os.path.exists(os.path.join(ck_dir, d, ".metadata"))) \
        if os.path.isdir(ck_dir) else []
    if done:
        m, o = get_state_dict(model, opt)
        sd = {"model": m, "optim": o, "step": 0}
        dcp.load(sd, checkpoint_id=os.path.join(ck_dir, done[-1]))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        step = sd["step"]
        for _ in range(step):
            sched.step()
    else:
        base = {"model": get_model_state_dict(model)}
        dcp.load(base, checkpoint_id=args.init)
        set_model_state_dict(model, base["model"])

    ds = Chunks(os.path.join(args.data, "train.bin"), args.seq_len)
    sampler = DistributedSampler(ds, num_replicas=dp.size(), rank=dp.get_local_rank(), seed=7, drop_last=True)
    loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    epoch = step // len(loader)
    sampler.set_epoch(epoch)
    it = iter(loader)

    fut = None
    t0 = time.time()
    while step < args.steps:
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            it = iter(loader)
            x, y = next(it)
        loss = F.cross_entropy(model(x.cuda(non_blocking=True)).flatten(0, 1).float(), y.cuda(non_blocking=True).flatten())
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
        opt.step()
        precompute_float8_dynamic_scale_for_fsdp(model)
        opt.zero_grad(set_to_none=True)
        sched.step()
        step += 1

        if step % 10 == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG, group=dp.get_group())
            if rank == 0:
                print(f"step {step} loss {l.item():.4f} gn {gn.item():.2f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / 10:.2f}s/it", flush=True)
            t0 = time.time()

        if step % args.ckpt_every == 0:
            if fut is not None:
                fut.result()
            m, o = get_state_dict(model, opt)
            fut = dcp.async_save({"model": m, "optim": o, "step": step},
                                 checkpoint_id=os.path.join(ck_dir, f"{step:07d}"))

        if step % args.snapshot_every == 0:
            snap = os.path.join(args.out, "snapshots", f"step{step:07d}", "consolidated.pt")
            n_tensors = save_consolidated(model, snap)
            dist.barrier()
            if rank == 0:
                idx_path = os.path.join(args.out, "snapshots", "index.json")
                idx = json.load(open(idx_path)) if os.path.exists(idx_path) else []
                idx.append({"step": step, "path": snap, "tensors": n_tensors})
                with open(idx_path + ".tmp", "w") as f:
                    json.dump(idx, f, indent=1)
                os.replace(idx_path + ".tmp", idx_path)

    if fut is not None:
        fut.result()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
