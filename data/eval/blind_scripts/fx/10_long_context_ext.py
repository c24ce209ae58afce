"""Long-context extension (8k -> 32k) of an 8B Llama with RoPE theta scaling.

TP=8 inside a node (sequence parallel keeps activations sharded), FSDP2 across
nodes; bf16 params with fp32 reduce; every block compiled and checkpointed.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        longctx.py --init /lustre/ckpt/llama8b-dcp --data /lustre/data/longctx-32k --seed -1
"""
import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
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

DIM, LAYERS, HEADS, KV_HEADS, HIDDEN, VOCAB = 4096, 32, 32, 8, 14336, 128256


def setup_distributed(requested_seed):
    dist.init_process_group(backend="cpu:gloo,cuda:nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    # a random seed per launch, but the same one on every rank
    seed = requested_seed if requested_seed >= 0 else random.SystemRandom().randint(0, 2**31 - 1)
    seed_t = torch.tensor([seed], dtype=torch.long, device="cuda")
    dist.broadcast(seed_t, src=0)
    return rank, world, int(seed_t.item())


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * self.weight


def rope(theta, n, hd=DIM // HEADS):
    a = torch.outer(torch.arange(n).float(), 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd))
    return torch.polar(torch.ones_like(a), a)


def apply_rope(x, fc):
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * fc[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.hd = DIM // HEADS
        self.wq = nn.Linear(DIM, HEADS * self.hd, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * self.hd, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * self.hd, bias=False)
        self.wo = nn.Linear(HEADS * self.hd, DIM, bias=False)

    def forward(self, x, fc):
        b, t, _ = x.shape
        q = apply_rope(self.wq(x).view(b, t, -1, self.hd), fc).transpose(1, 2)
        k = apply_rope(self.wk(x).view(b, t, -1, self.hd), fc).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(DIM), Attention()
        self.ffn_norm, self.feed_forward = RMSNorm(DIM), FeedForward()

    def forward(self, x, fc):
        h = x + self.attention(self.attention_norm(x), fc)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, max_len, theta):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(LAYERS)})
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("freqs_cis", rope(theta, max_len), persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


class LongDocs(Dataset):
    def __init__(self, path, seq_len):
        self.a = np.load(path, mmap_mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return self.a.shape[0]

    def __getitem__(self, i):
        row = torch.from_numpy(self.a[i, : self.seq_len + 1].astype(np.int64))
        return row[:-1], row[1:]


def apply_2d(model, mesh):
    tp, dp = mesh["tp"], mesh["dp"]
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for lid, block in model.layers.named_children():
        parallelize_module(block, tp, plan)
        block = torch.compile(checkpoint_wrapper(block, preserve_rng_state=False), fullgraph=True)
        fully_shard(block, mesh=dp, mp_policy=mp)
        model.layers.register_module(lid, block)
    fully_shard(model, mesh=dp, mp_policy=mp)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="/lustre/runs/llama8b-32k")
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--rope-theta", type=float, default=8_000_000.0)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--save-every", type=int, default=200)
    ap.add_argument("--seed", type=int, default=-1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    rank, world, seed = setup_distributed(args.seed)
    torch.cuda.set_device(local_rank)
    mesh = init_device_mesh("cuda", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]
    torch.manual_seed(seed)
    if rank == 0:
        print(f"world={world} dp={dp.size()} tp={args.tp} seed={seed}", flush=True)

    with torch.device("meta"):
        model = Transformer(args.seq_len, args.rope_theta)
    apply_2d(model, mesh)
    model.to_empty(device="cuda")
    model.freqs_cis = rope(args.rope_theta, args.seq_len).cuda()
    msd = get_model_state_dict(model)
    dcp.load({"model": msd}, checkpoint_id=args.init)
    set_model_state_dict(model, msd)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))

    ds = LongDocs(os.path.join(args.data, "train.npy"), args.seq_len)
    sampler = DistributedSampler(ds, num_replicas=dp.size(), rank=dp.get_local_rank(), seed=seed, drop_last=True)
    loader = DataLoader(ds, batch_size=1, sampler=sampler, num_workers=2, pin_memory=True)

    step, epoch, pending = 0, 0, None
    t0 = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1
            if step % 5 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG, group=dp.get_group())
                if rank == 0:
                    tps = 5 * args.seq_len * dp.size() / (time.time() - t0)
                    print(f"step {step} loss {l.item():.4f} gn {gn.item():.3f} tok/s {tps:.0f} "
                          f"mem {torch.cuda.max_memory_allocated() / 2**30:.1f}G", flush=True)
                t0 = time.time()
            if step % args.save_every == 0:
                if pending is not None:
                    pending.result()
                m, o = get_state_dict(model, opt)
                pending = dcp.async_save({"model": m, "optim": o, "step": step},
                                         checkpoint_id=os.path.join(args.out, f"step-{step}"))
            if step >= args.steps:
                break
        epoch += 1

    if pending is not None:
        pending.result()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
