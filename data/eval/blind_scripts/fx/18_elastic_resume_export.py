"""Resumable pretraining that may be restarted on a different number of nodes.

* DCP checkpoints are resharded on load, so a run saved on 32 GPUs resumes on 16.
* Data order is one global permutation; the position is kept in samples, not in
  per-rank batches, so it survives a change of the data-parallel degree.
* The global batch is fixed in sequences; gradient accumulation absorbs the change.
* The tokenized cache is built once (rank 0) while the others wait on a gloo barrier.

    torchrun --nnodes=$NNODES --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        elastic_pretrain.py --raw /shared/raw/books --cache /shared/cache --out /shared/runs/b3 --tp 4
"""
import argparse
import glob
import math
import os
from datetime import timedelta

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

D, NL, NH, NKV, FF, VOCAB = 3072, 28, 24, 8, 8192, 128256


def build_cache(raw_dir, cache_path, tokenizer_name):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_name)
    tmp = cache_path + f".tmp{os.getpid()}"
    with open(tmp, "wb") as out:
        for path in sorted(glob.glob(os.path.join(raw_dir, "*.txt"))):
            with open(path, encoding="utf-8") as f:
                ids = tok(f.read(), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            out.write(np.asarray(ids, dtype=np.uint32).tobytes())
    os.replace(tmp, cache_path)  # atomic: readers never see a partial file


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * self.weight


def rope_freqs(n, hd=D // NH):
    a = torch.outer(torch.arange(n).float(), 500000.0 ** (-torch.arange(0, hd, 2).float() / hd))
    return torch.polar(torch.ones_like(a), a)


def rope(x, f):
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * f[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.hd = D // NH
        self.wq, self.wo = nn.Linear(D, NH * self.hd, bias=False), nn.Linear(NH * self.hd, D, bias=False)
        self.wk, self.wv = nn.Linear(D, NKV * self.hd, bias=False), nn.Linear(D, NKV * self.hd, bias=False)

    def forward(self, x, f):
        b, t, _ = x.shape
        q = rope(self.wq(x).view(b, t, -1, self.hd), f).transpose(1, 2)
        k = rope(self.wk(x).view(b, t, -1, self.hd), f).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention, self.ffn_norm = RMSNorm(D), Attention(), RMSNorm(D)
        self.feed_forward = nn.ModuleDict(dict(w1=nn.Linear(D, FF, bias=False), w3=nn.Linear(D, FF, bias=False),
                                               w2=nn.Linear(FF, D, bias=False)))

    def forward(self, x, f):
        x = x + self.attention(self.attention_norm(x), f)
        h, ff = self.ffn_norm(x), self.feed_forward
        return x + ff["w2"](F.silu(ff["w1"](h)) * ff["w3"](h))


class Transformer(nn.Module):
    def __init__(self, seq_len):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block() for _ in range(NL))
        self.norm = RMSNorm(D)
        self.output = nn.Linear(D, VOCAB, bias=False)
        self.register_buffer("freqs_cis", rope_freqs(seq_len), persistent=False)

    def forward(self, ids):
        h = self.tok_embeddings(ids)
        for blk in self.layers:
            h = blk(h, self.freqs_cis)
        return self.output(self.norm(h))


def parallelize(model, mesh):
    tp, dp = mesh["tp"], mesh["dp"]
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, blk in enumerate(model.layers):
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
        blk = torch.compile(checkpoint_wrapper(blk, preserve_rng_state=False))
        fully_shard(blk, mesh=dp, mp_policy=mp)
        model.layers[i] = blk
    fully_shard(model, mesh=dp, mp_policy=mp)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", default="meta-llama/Llama-3.2-3B")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--steps", type=int, default=30000)
    ap.add_argument("--save-every", type=int, default=250)
    ap.add_argument("--export", action="store_true")
    args = ap.parse_args()

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]
    dp_rank, dp_size = dp.get_local_rank(), dp.size()
    # tokenization can take a while; nccl's default timeout would fire first
    slow_pg = dist.new_group(backend="gloo", timeout=timedelta(hours=3))

    cache = os.path.join(args.cache, "books.u32")
    if rank == 0 and not os.path.exists(cache):
        build_cache(args.raw, cache, args.tokenizer)
    dist.barrier(group=slow_pg)
    tokens = np.memmap(cache, dtype=np.uint32, mode="r")
    n_seq = (len(tokens) - 1) // args.seq_len
    perm = np.random.default_rng(1234).permutation(n_seq)  # identical on every rank

    assert args.global_batch % (args.micro_batch * dp_size) == 0
    accum = args.global_batch // (args.micro_batch * dp_size)

    def micro_batch(sample_pos, micro_idx):
        start = sample_pos + micro_idx * args.micro_batch * dp_size + dp_rank * args.micro_batch
        idx = perm[np.arange(start, start + args.micro_batch) % n_seq]
        rows = [torch.from_numpy(tokens[i * args.seq_len: (i + 1) * args.seq_len + 1].astype(np.int64)) for i in idx]
        b = torch.stack(rows).cuda(non_blocking=True)
        return b[:, :-1], b[:, 1:]

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args.seq_len)
    parallelize(model, mesh)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                nn.init.normal_(p, std=0.02)
    model.freqs_cis = rope_freqs(args.seq_len).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def lr_at(s):
        return args.lr * min(1.0, (s + 1) / 1000) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))

    step, samples = 0, 0
    ckpts = sorted(glob.glob(os.path.join(args.out, "ckpt", "*", ".metadata")))
    if ckpts:
        m, o = get_state_dict(model, opt)
        sd = {"model": m, "optim": o, "progress": {"step": 0, "samples": 0}}
        # resharding on load: the saving job's world size does not matter here
        dcp.load(sd, checkpoint_id=os.path.dirname(ckpts[-1]))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        step, samples = sd["progress"]["step"], sd["progress"]["samples"]
        if rank == 0:
            print(f"resumed step {step} samples {samples} on world={world} (dp={dp_size}, accum={accum})")

    fut = None
    while step < args.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        acc_loss = torch.zeros((), device="cuda")
        for mi in range(accum):
            x, y = micro_batch(samples, mi)
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()) / accum
            loss.backward()
            acc_loss += loss.detach()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        samples += args.global_batch

        if step % 10 == 0:
            dist.all_reduce(acc_loss, op=dist.ReduceOp.AVG, group=dp.get_group())
            if rank == 0:
                print(f"step {step} loss {acc_loss.item():.4f} gn {gn.item():.2f} lr {lr_at(step):.2e}", flush=True)

        if step % args.save_every == 0:
            if fut is not None:
                fut.result()
            m, o = get_state_dict(model, opt)
            fut = dcp.async_save({"model": m, "optim": o, "progress": {"step": step, "samples": samples}},
                                 checkpoint_id=os.path.join(args.out, "ckpt", f"{step:07d}"),
                                 process_group=slow_pg)

    if fut is not None:
        fut.result()
    if args.export:
        # collective on every rank; with cpu_offload only rank 0 ends up holding the full tensors
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full, os.path.join(args.out, "consolidated.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
