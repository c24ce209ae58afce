"""Llama pretraining driven by an OmegaConf YAML (CLI dotlist overrides allowed).

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        train_omega.py config=configs/llama_2b.yaml parallel.tp=4 train.steps=40000

Parallelism: tensor parallel inside a node, FSDP2 over the data-parallel dim,
bf16 params with fp32 gradient reduction, compiled blocks with activation
checkpointing, asynchronous DCP checkpoints.
"""
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
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

DEFAULTS = OmegaConf.create({
    "model": {"dim": 2560, "n_layers": 24, "n_heads": 20, "n_kv_heads": 4, "ffn": 6912, "vocab": 100352,
              "seq_len": 4096, "rope_theta": 500000.0},
    "parallel": {"tp": 4},
    "train": {"data": "???", "out": "???", "micro_batch": 2, "lr": 3e-4, "min_lr_ratio": 0.1,
              "warmup": 2000, "steps": 60000, "clip": 1.0, "log_every": 10, "ckpt_every": 1000, "seed": 0},
})


def load_config():
    cli = OmegaConf.from_dotlist(sys.argv[1:])
    cfg = DEFAULTS
    if "config" in cli:
        cfg = OmegaConf.merge(cfg, OmegaConf.load(cli.pop("config")))
    return OmegaConf.merge(cfg, cli)


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * self.weight


def rope_table(m):
    hd = m.dim // m.n_heads
    a = torch.outer(torch.arange(m.seq_len).float(), m.rope_theta ** (-torch.arange(0, hd, 2).float() / hd))
    return torch.polar(torch.ones_like(a), a)


def rope(x, tab):
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * tab[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.hd = m.dim // m.n_heads
        self.wq = nn.Linear(m.dim, m.n_heads * self.hd, bias=False)
        self.wk = nn.Linear(m.dim, m.n_kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(m.dim, m.n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(m.n_heads * self.hd, m.dim, bias=False)

    def forward(self, x, tab):
        b, t, _ = x.shape
        q = rope(self.wq(x).view(b, t, -1, self.hd), tab).transpose(1, 2)
        k = rope(self.wk(x).view(b, t, -1, self.hd), tab).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.w1 = nn.Linear(m.dim, m.ffn, bias=False)
        self.w2 = nn.Linear(m.ffn, m.dim, bias=False)
        self.w3 = nn.Linear(m.dim, m.ffn, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(m.dim), Attention(m)
        self.ffn_norm, self.feed_forward = RMSNorm(m.dim), FeedForward(m)

    def forward(self, x, tab):
        x = x + self.attention(self.attention_norm(x), tab)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m
        self.tok_embeddings = nn.Embedding(m.vocab, m.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(m) for i in range(m.n_layers)})
        self.norm = RMSNorm(m.dim)
        self.output = nn.Linear(m.dim, m.vocab, bias=False)
        self.register_buffer("tab", rope_table(m), persistent=False)

    @torch.no_grad()
    def init_weights(self):
        self.tab = rope_table(self.m).to(self.tok_embeddings.weight.device)
        for n, p in self.named_parameters():
            if n.endswith("norm.weight"):
                nn.init.ones_(p)
            elif n.endswith(("wo.weight", "w2.weight")):
                nn.init.trunc_normal_(p, std=0.02 / math.sqrt(2 * self.m.n_layers))
            else:
                nn.init.trunc_normal_(p, std=0.02)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.tab)
        return self.output(self.norm(h))


class Tokens(Dataset):
    def __init__(self, path, seq_len):
        self.t, self.L = np.memmap(path, dtype=np.uint32, mode="r"), seq_len

    def __len__(self):
        return (len(self.t) - 1) // self.L

    def __getitem__(self, i):
        w = torch.from_numpy(self.t[i * self.L: (i + 1) * self.L + 1].astype(np.int64))
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


def parallelize(model, mesh):
    tp, dp = mesh["tp"], mesh["dp"]
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for lid, blk in model.layers.named_children():
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
        blk = torch.compile(checkpoint_wrapper(blk, preserve_rng_state=False), fullgraph=True)
        fully_shard(blk, mesh=dp, mp_policy=mp)
        model.layers.register_module(lid, blk)
    fully_shard(model, mesh=dp, mp_policy=mp)


def main():
    cfg = load_config()
    m, tc = cfg.model, cfg.train

    local_rank = int(os.environ["LOCAL_RANK"])
    gpus_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("cpu:gloo,cuda:nccl")
    rank = dist.get_rank()

    tp = cfg.parallel.tp
    assert gpus_per_node % tp == 0, "tp must divide the GPUs of a node"
    dp_shard = gpus_per_node // tp
    mesh = init_device_mesh("cuda", (dp_shard, tp), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]
    if rank == 0:
        print(OmegaConf.to_yaml(cfg), flush=True)
        print(f"mesh: dp={dp_shard} tp={tp}", flush=True)

    torch.manual_seed(tc.seed)
    with torch.device("meta"):
        model = Transformer(m)
    parallelize(model, mesh)
    model.to_empty(device="cuda")
    model.init_weights()

    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def lr_mult(s):
        if s < tc.warmup:
            return (s + 1) / tc.warmup
        prog = min(1.0, (s - tc.warmup) / (tc.steps - tc.warmup))
        return tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_mult)
    state = State(model, opt)
    ck = os.path.join(tc.out, "checkpoints")
    done = sorted(d for d in os.listdir(ck) if os.path.isfile(os.path.join(ck, d, ".metadata"))) \
        if os.path.isdir(ck) else []
    if done:
        dcp.load({"state": state}, checkpoint_id=os.path.join(ck, done[-1]))
        for _ in range(state.step):
            sched.step()

    ds = Tokens(os.path.join(tc.data, "train.bin"), m.seq_len)
    sampler = DistributedSampler(ds, num_replicas=dp.size(), rank=dp.get_local_rank(), seed=tc.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=tc.micro_batch, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    epoch = state.step // len(loader)
    sampler.set_epoch(epoch)
    it = iter(loader)
    fut = None
    t0 = time.time()
    while state.step < tc.steps:
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            it = iter(loader)
            x, y = next(it)
        loss = F.cross_entropy(model(x.cuda(non_blocking=True)).flatten(0, 1).float(), y.cuda(non_blocking=True).flatten())
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip).full_tensor()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        state.step += 1
        if state.step % tc.log_every == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG, group=dp.get_group())
            if rank == 0:
                print(f"step {state.step} loss {l.item():.4f} gn {gn.item():.2f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / tc.log_every:.2f}s/it", flush=True)
            t0 = time.time()
        if state.step % tc.ckpt_every == 0:
            if fut is not None:
                fut.result()
            fut = dcp.async_save({"state": state}, checkpoint_id=os.path.join(ck, f"{state.step:07d}"))

    if fut is not None:
        fut.result()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
