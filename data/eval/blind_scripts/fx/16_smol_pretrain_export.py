"""SmolLM-style 1.7B pretraining with consolidated-weight export.

Stage 1 (pretrain) and stage 2 (anneal) are the same script: stage 2 starts from
the consolidated.pt that stage 1 exported (--init-from), with a fresh optimizer.

FSDP2 x TP on a 2D mesh, bf16 mixed precision, torch.compile per block,
activation checkpointing, async distributed checkpoints.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        smol.py --stage pretrain --data /fsx/smol/pretrain --out /fsx/runs/smol-s1 --export
    torchrun ... smol.py --stage anneal --data /fsx/smol/anneal --out /fsx/runs/smol-s2 \
        --init-from /fsx/runs/smol-s1/consolidated.pt
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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, Dataset, DistributedSampler

MODEL = dict(dim=2048, n_layers=24, n_heads=32, n_kv_heads=32, ffn=8192, vocab=49152, theta=130000.0)


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * self.weight


def freqs(n):
    hd = MODEL["dim"] // MODEL["n_heads"]
    a = torch.outer(torch.arange(n).float(), MODEL["theta"] ** (-torch.arange(0, hd, 2).float() / hd))
    return torch.polar(torch.ones_like(a), a)


def rope(x, f):
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * f[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        d, h = MODEL["dim"], MODEL["n_heads"]
        self.hd = d // h
        self.wq, self.wk, self.wv = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, x, f):
        b, t, _ = x.shape
        q = rope(self.wq(x).view(b, t, -1, self.hd), f).transpose(1, 2)
        k = rope(self.wk(x).view(b, t, -1, self.hd), f).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.hd).transpose(1, 2)
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        d, f = MODEL["dim"], MODEL["ffn"]
        self.w1, self.w3, self.w2 = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(MODEL["dim"]), Attention()
        self.ffn_norm, self.feed_forward = RMSNorm(MODEL["dim"]), FeedForward()

    def forward(self, x, f):
        x = x + self.attention(self.attention_norm(x), f)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, seq_len):
        super().__init__()
        self.seq_len = seq_len
        self.tok_embeddings = nn.Embedding(MODEL["vocab"], MODEL["dim"])
        self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(MODEL["n_layers"])})
        self.norm = RMSNorm(MODEL["dim"])
        self.output = nn.Linear(MODEL["dim"], MODEL["vocab"], bias=False)
        self.register_buffer("freqs_cis", freqs(seq_len), persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


class TokenBlocks(Dataset):
    def __init__(self, path, seq_len):
        self.a = np.memmap(path, dtype=np.uint16, mode="r")
        self.n = seq_len

    def __len__(self):
        return (len(self.a) - 1) // self.n

    def __getitem__(self, i):
        w = torch.from_numpy(self.a[i * self.n: (i + 1) * self.n + 1].astype(np.int64))
        return w[:-1], w[1:]


def parallelize(model, mesh):
    tp, dp = mesh["tp"], mesh["dp"]
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for layer_id, block in model.layers.named_children():
        parallelize_module(block, tp, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
        block = checkpoint_wrapper(block, preserve_rng_state=False)
        block = torch.compile(block, fullgraph=True)
        model.layers.register_module(layer_id, block)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    n = len(model.layers)
    for i, block in enumerate(model.layers.values()):
        fully_shard(block, mesh=dp, mp_policy=mp, reshard_after_forward=i < n - 1)
    fully_shard(model, mesh=dp, mp_policy=mp)


def export_consolidated(model, path, rank):
    """Gather every parameter (collective) and write one bf16 file from rank 0."""
    full = {}
    for k, v in model.state_dict().items():
        t = v.full_tensor() if isinstance(v, DTensor) else v
        if rank == 0:
            full[k] = t.to(torch.bfloat16).cpu()
    if rank == 0:
        torch.save(full, path)
    dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", choices=["pretrain", "anneal"], required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--init-from", default=None)
    ap.add_argument("--export", action="store_true")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--save-every", type=int, default=2000)
    args = ap.parse_args()

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args.seq_len)
    parallelize(model, mesh)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                nn.init.normal_(p, std=0.02)
    model.freqs_cis = freqs(args.seq_len).cuda()

    if args.init_from:
        sd = torch.load(args.init_from, map_location="cpu", mmap=True, weights_only=True) if rank == 0 else {}
        set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        del sd

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    if args.stage == "pretrain":
        # warmup-stable: constant after warmup, the decay happens in the anneal stage
        lr_fn = lambda s: min(1.0, (s + 1) / 2000)  # noqa: E731
    else:
        lr_fn = lambda s: max(0.0, 1.0 - s / args.steps)  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_fn)

    step = 0
    dcp_dir = os.path.join(args.out, "dcp")
    done = sorted(d for d in os.listdir(dcp_dir) if os.path.exists(os.path.join(dcp_dir, d, ".metadata"))) \
        if os.path.isdir(dcp_dir) else []
    if done:
        m, o = get_state_dict(model, opt)
        sd = {"model": m, "optim": o, "step": 0}
        dcp.load(sd, checkpoint_id=os.path.join(dcp_dir, done[-1]))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        step = sd["step"]
        for _ in range(step):
            sched.step()

    ds = TokenBlocks(os.path.join(args.data, "train.bin"), args.seq_len)
    sampler = DistributedSampler(ds, num_replicas=dp.size(), rank=dp.get_local_rank(), seed=0, drop_last=True)
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
        opt.zero_grad(set_to_none=True)
        sched.step()
        step += 1
        if step % 25 == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG, group=dp.get_group())
            if rank == 0:
                print(f"[{args.stage}] step {step} loss {l.item():.4f} gn {gn.item():.2f} "
                      f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 25:.2f}s/it", flush=True)
            t0 = time.time()
        if step % args.save_every == 0:
            if fut is not None:
                fut.result()
            m, o = get_state_dict(model, opt)
            fut = dcp.async_save({"model": m, "optim": o, "step": step},
                                 checkpoint_id=os.path.join(dcp_dir, f"step{step:07d}"))

    if fut is not None:
        fut.result()
    if args.export:
        export_consolidated(model, os.path.join(args.out, "consolidated.pt"), rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
