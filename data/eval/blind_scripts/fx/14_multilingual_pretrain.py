"""Multilingual 2B pretraining with a 256k-vocab tokenizer.

Per-language token files are sampled with temperature-scaled weights. The big
embedding/output matrices are sharded by TP (vocab-parallel), everything by FSDP2.

    torchrun --nproc_per_node=8 ml_pretrain.py --langs configs/langs.yaml --tp 4 \
        --save_dir /mnt/shared/ml2b
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
import yaml
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
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


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--langs", required=True)
    p.add_argument("--save_dir", required=True)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--max_steps", type=int, default=120000)
    p.add_argument("--warmup_steps", type=int, default=2000)
    p.add_argument("--temperature", type=float, default=0.3)
    p.add_argument("--save_interval", type=int, default=1000)
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


class LangMixture(Dataset):
    def __init__(self, langs, seq_len, n_samples, temperature, seed=1234):
        self.arrs = {k: np.memmap(v["path"], dtype=np.uint32, mode="r") for k, v in langs.items()}
        names = sorted(langs)
        sizes = np.array([len(self.arrs[k]) for k in names], dtype=np.float64)
        probs = (sizes / sizes.sum()) ** temperature
        probs /= probs.sum()
        g = np.random.default_rng(seed)
        which = g.choice(len(names), size=n_samples, p=probs)
        self.items = [(names[w], int(g.integers(0, len(self.arrs[names[w]]) - seq_len - 1))) for w in which]
        self.seq_len = seq_len

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        lang, off = self.items[i]
        a = torch.from_numpy(self.arrs[lang][off: off + self.seq_len + 1].astype(np.int64))
        return a[:-1], a[1:]


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * self.weight


def rope_table(hd, n):
    a = torch.outer(torch.arange(n).float(), 10000.0 ** (-torch.arange(0, hd, 2).float() / hd))
    return torch.polar(torch.ones_like(a), a)


def rope(x, tab):
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * tab[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, d, nh, nkv):
        super().__init__()
        self.hd = d // nh
        self.wq = nn.Linear(d, nh * self.hd, bias=False)
        self.wk = nn.Linear(d, nkv * self.hd, bias=False)
        self.wv = nn.Linear(d, nkv * self.hd, bias=False)
        self.wo = nn.Linear(nh * self.hd, d, bias=False)

    def forward(self, x, tab):
        b, t, _ = x.shape
        q = rope(self.wq(x).view(b, t, -1, self.hd), tab).transpose(1, 2)
        k = rope(self.wk(x).view(b, t, -1, self.hd), tab).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class GatedMLP(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))


class Layer(nn.Module):
    def __init__(self, d, nh, nkv, f):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(d), Attention(d, nh, nkv)
        self.ffn_norm, self.feed_forward = RMSNorm(d), GatedMLP(d, f)

    def forward(self, x, tab):
        x = x + self.attention(self.attention_norm(x), tab)
        return x + self.feed_forward(self.ffn_norm(x))


class MLM(nn.Module):
    def __init__(self, vocab=256000, d=2048, n_layers=18, nh=16, nkv=4, f=16384, seq_len=4096):
        super().__init__()
        self.d = d
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, nh, nkv, f) for _ in range(n_layers))
        self.norm = RMSNorm(d)
        self.output = nn.Linear(d, vocab, bias=False)
        self.hd = d // nh
        self.register_buffer("tab", rope_table(self.hd, seq_len), persistent=False)

    def forward(self, idx):
        h = self.tok_embeddings(idx) * math.sqrt(self.d)
        for layer in self.layers:
            h = layer(h, self.tab)
        return self.output(self.norm(h))


def parallelize(model, mesh):
    tp, dp = mesh["tp"], mesh["dp"]
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, layer in enumerate(model.layers):
        parallelize_module(layer, tp, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
        layer = torch.compile(checkpoint_wrapper(layer, preserve_rng_state=False))
        fully_shard(layer, mesh=dp, mp_policy=mp)
        model.layers[i] = layer
    fully_shard(model, mesh=dp, mp_policy=mp)


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group("cpu:gloo,cuda:nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]

    with open(args.langs) as f:
        langs = yaml.safe_load(f)
    ds = LangMixture(langs, args.seq_len, args.max_steps * args.batch_size * dp.size(), args.temperature)
    sampler = DistributedSampler(ds, num_replicas=dp.size(), rank=dp.get_local_rank(), shuffle=False)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True)

    torch.manual_seed(0)
    with torch.device("meta"):
        model = MLM(seq_len=args.seq_len)
    parallelize(model, mesh)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                nn.init.ones_(p)
            elif "tok_embeddings" in n:
                nn.init.normal_(p, std=model.d ** -0.5)
            else:
                nn.init.normal_(p, std=0.02)
    model.tab = rope_table(model.hd, args.seq_len).cuda()

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / args.warmup_steps if s < args.warmup_steps
        else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - args.warmup_steps) / (args.max_steps - args.warmup_steps))))

    step = 0
    tags = sorted(d for d in os.listdir(args.save_dir)
                  if os.path.exists(os.path.join(args.save_dir, d, ".metadata"))) if os.path.isdir(args.save_dir) else []
    if tags:
        m, o = get_state_dict(model, opt)
        sd = {"model": m, "optim": o, "sched": sched.state_dict(), "step": 0}
        dcp.load(sd, checkpoint_id=os.path.join(args.save_dir, tags[-1]))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        sched.load_state_dict(sd["sched"])
        step = sd["step"]
        if rank == 0:
            print(f"resuming from {tags[-1]}", flush=True)

    pending = None
    it = iter(loader)
    for _ in range(step):  # samples are pre-drawn; skip the ones already consumed
        next(it)
    t0 = time.time()
    while step < args.max_steps:
        x, y = next(it)
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        step += 1
        if step % 10 == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG, group=dp.get_group())
            if rank == 0:
                print(f"step {step} loss {l.item():.4f} gnorm {gnorm.item():.3f} "
                      f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 10:.2f}s/it", flush=True)
            t0 = time.time()
        if step % args.save_interval == 0:
            if pending is not None:
                pending.result()
            m, o = get_state_dict(model, opt)
            pending = dcp.async_save({"model": m, "optim": o, "sched": sched.state_dict(), "step": step},
                                     checkpoint_id=os.path.join(args.save_dir, f"step_{step:07d}"))
    if pending is not None:
        pending.result()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
