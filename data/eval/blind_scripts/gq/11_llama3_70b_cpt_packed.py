"""Domain-adaptive continued pre-training of Llama-3-70B on packed token shards.

Parallelism: 2D DeviceMesh ("dp", "tp"): TP=8 inside a node (Megatron-style
column/row sharding + sequence parallel norms + loss parallel), FSDP2 across
the dp dimension. Activation checkpointing on every block. Checkpoints are
written asynchronously with torch.distributed.checkpoint (sharded, every rank
writes its own shards to the shared Lustre filesystem).

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=$MASTER_ADDR:29500 11_llama3_70b_cpt_packed.py \
        --config configs/l3_70b_cpt.yaml max_steps=4000
"""
import argparse
import dataclasses
import json
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
import yaml
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)
from torch.utils.data import DataLoader, Dataset, DistributedSampler


@dataclass
class Config:
    dim: int = 8192
    n_layers: int = 80
    n_heads: int = 64
    n_kv_heads: int = 8
    ffn_dim: int = 28672
    vocab_size: int = 128256
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tp: int = 8
    train_bin: str = "/lustre/data/cpt/train.bin"
    val_bin: str = "/lustre/data/cpt/val.bin"
    seq_len: int = 4096
    micro_batch: int = 1
    grad_accum: int = 8
    lr: float = 1.5e-5
    min_lr: float = 1.5e-6
    warmup: int = 200
    max_steps: int = 5000
    weight_decay: float = 0.1
    clip: float = 1.0
    init_ckpt: str = "/lustre/ckpt/llama3-70b-dcp"
    out_dir: str = "/lustre/runs/l3-70b-cpt"
    save_every: int = 250
    eval_every: int = 250
    eval_iters: int = 40
    log_every: int = 10
    seed: int = 42


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("overrides", nargs="*", help="key=value")
    a = ap.parse_args()
    cfg = Config()
    if a.config:
        with open(a.config) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, v)
    for kv in a.overrides:
        k, v = kv.split("=", 1)
        setattr(cfg, k, type(getattr(cfg, k))(v))
    return cfg


def rope_cache(head_dim, max_len, theta):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_len).float(), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    s = x.shape[1]
    cos, sin = cos[:s, None, :].to(x.dtype), sin[:s, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.hd, self.rep = c.dim // c.n_heads, c.n_heads // c.n_kv_heads
        self.q_proj = nn.Linear(c.dim, c.n_heads * self.hd, bias=False)
        self.k_proj = nn.Linear(c.dim, c.n_kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(c.dim, c.n_kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(c.n_heads * self.hd, c.dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = apply_rope(self.q_proj(x).view(b, s, -1, self.hd), cos, sin)
        k = apply_rope(self.k_proj(x).view(b, s, -1, self.hd), cos, sin)
        v = self.v_proj(x).view(b, s, -1, self.hd)
        k, v = k.repeat_interleave(self.rep, 2), v.repeat_interleave(self.rep, 2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.up_proj = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.down_proj = nn.Linear(c.ffn_dim, c.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.ln1, self.ln2 = nn.RMSNorm(c.dim, eps=c.norm_eps), nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.attn, self.mlp = Attention(c), MLP(c)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.ln1(x), cos, sin)
        return x + self.mlp(self.ln2(x))


class LlamaLM(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleDict({str(i): Block(c) for i in range(c.n_layers)})
        self.norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.lm_head = nn.Linear(c.dim, c.vocab_size, bias=False)
        self.init_buffers()

    def init_buffers(self):
        cos, sin = rope_cache(self.c.dim // self.c.n_heads, 2 * self.c.seq_len, self.c.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx):
        h = self.embed(idx)
        for blk in self.layers.values():
            h = blk(h, self.cos, self.sin)
        return self.lm_head(self.norm(h))


def parallelize(model, mesh):
    tp, dp = mesh["tp"], mesh["dp"]
    parallelize_module(model, tp, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for blk in model.layers.values():
        parallelize_module(blk, tp, {
            "ln1": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                       desired_input_layouts=(Replicate(), None, None)),
            "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "ln2": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for name in list(model.layers.keys()):
        blk = checkpoint_wrapper(model.layers[name])
        fully_shard(blk, mesh=dp, mp_policy=mp)
        model.layers[name] = blk
    fully_shard(model, mesh=dp, mp_policy=mp)


class PackedTokens(Dataset):
    def __init__(self, path, seq_len):
        self.tokens = np.memmap(path, dtype=np.uint32, mode="r")
        self.L = seq_len
        self.n = (len(self.tokens) - 1) // seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        w = torch.from_numpy(self.tokens[i * self.L: i * self.L + self.L + 1].astype(np.int64))
        return w[:-1], w[1:]


class TrainState:
    def __init__(self, model, optim):
        self.model, self.optim, self.step = model, optim, 0

    def state_dict(self):
        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd, "step": torch.tensor(self.step)}

    def load_state_dict(self, sd):
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.step = int(sd["step"])


def lr_at(step, c):
    if step < c.warmup:
        return c.lr * (step + 1) / c.warmup
    p = min(1.0, (step - c.warmup) / max(1, c.max_steps - c.warmup))
    return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1 + math.cos(math.pi * p))


def local_value(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def main():
    c = load_config()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device())
    world = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cuda", (world // c.tp, c.tp), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]
    rank, dp_rank, dp_size = dist.get_rank(), dp.get_local_rank(), dp.size()
    torch.manual_seed(c.seed)
    # async checkpoint staging/finishing runs in a background thread: give it its own CPU group
    ckpt_pg = dist.new_group(backend="gloo")

    if rank == 0:
        os.makedirs(c.out_dir, exist_ok=True)
        with open(os.path.join(c.out_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(c), f, indent=2)
    dist.barrier()

    train_ds, val_ds = PackedTokens(c.train_bin, c.seq_len), PackedTokens(c.val_bin, c.seq_len)
    sampler = DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank, seed=c.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=c.micro_batch, sampler=sampler, num_workers=2, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=c.micro_batch,
                            sampler=DistributedSampler(val_ds, dp_size, dp_rank, shuffle=False, drop_last=True))

    with torch.device("meta"):
        model = LlamaLM(c)
    parallelize(model, mesh)
    model.to_empty(device=device)
    with torch.device(device):
        model.init_buffers()
    dcp.load({"model": get_model_state_dict(model)}, checkpoint_id=c.init_ckpt)

    optim = torch.optim.AdamW(model.parameters(), lr=c.lr, betas=(0.9, 0.95),
                              weight_decay=c.weight_decay, foreach=True)
    state = TrainState(model, optim)
    latest = os.path.join(c.out_dir, "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            ckpt = f.read().strip()
        dcp.load({"train": state}, checkpoint_id=os.path.join(c.out_dir, ckpt))
        if rank == 0:
            print(f"resumed from {ckpt} (step {state.step})", flush=True)

    def micro_batches():
        consumed = state.step * c.grad_accum
        epoch, skip = divmod(consumed, len(loader))
        while True:
            sampler.set_epoch(epoch)
            for i, b in enumerate(loader):
                if i >= skip:
                    yield b
            epoch, skip = epoch + 1, 0

    it = micro_batches()
    pending_save, pending_name = None, None
    model.train()
    t0 = time.time()
    while state.step < c.max_steps:
        for g in optim.param_groups:
            g["lr"] = lr_at(state.step, c)
        loss_acc = torch.zeros((), device=device)
        for _ in range(c.grad_accum):
            x, y = next(it)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with loss_parallel():
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(0, 1)) / c.grad_accum
                loss.backward()
            loss_acc += local_value(loss.detach())
        gnorm = local_value(torch.nn.utils.clip_grad_norm_(model.parameters(), c.clip, foreach=True))
        optim.step()
        optim.zero_grad(set_to_none=True)
        state.step += 1

        if state.step % c.log_every == 0:
            dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG, group=dp.get_group())
            if rank == 0:
                dt = (time.time() - t0) / c.log_every
                tps = c.micro_batch * c.grad_accum * c.seq_len * dp_size / dt
                print(f"step {state.step} loss {loss_acc.item():.4f} gnorm {gnorm.item():.3f} "
                      f"lr {lr_at(state.step - 1, c):.2e} tok/s {tps:,.0f}", flush=True)
            t0 = time.time()

        if state.step % c.eval_every == 0:
            model.eval()
            acc = torch.zeros(2, device=device)
            with torch.no_grad():
                for i, (x, y) in enumerate(val_loader):
                    if i == c.eval_iters:
                        break
                    with loss_parallel():
                        l = F.cross_entropy(model(x.to(device)).flatten(0, 1), y.to(device).flatten(0, 1))
                    acc += torch.stack([local_value(l).float(), torch.ones((), device=device)])
            dist.all_reduce(acc, group=dp.get_group())
            if rank == 0:
                print(f"step {state.step} val_loss {(acc[0] / acc[1]).item():.4f}", flush=True)
            model.train()

        if state.step % c.save_every == 0 or state.step == c.max_steps:
            if pending_save is not None:
                # previous checkpoint is complete (metadata written) once its future resolves
                pending_save.result()
                if rank == 0:
                    with open(latest, "w") as f:
                        f.write(pending_name)
            pending_name = f"step_{state.step:06d}"
            pending_save = dcp.async_save({"train": state}, checkpoint_id=os.path.join(c.out_dir, pending_name),
                                          process_group=ckpt_pg)

    if pending_save is not None:
        pending_save.result()
        if rank == 0:
            with open(latest, "w") as f:
                f.write(pending_name)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
