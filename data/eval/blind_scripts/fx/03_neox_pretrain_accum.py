"""1.4B NeoX-style decoder pretraining on pre-tokenized shards.

2D parallelism (FSDP2 x TP), bf16 compute with fp32 master weights and fp32
gradient reduction, compiled blocks, selective AC, DCP async checkpoints.

    torchrun --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29400 \
        pretrain.py --tp 2 --data_dir /mnt/fsx/pile-tok --out_dir /mnt/fsx/runs/neox-1b4
"""
import argparse
import dataclasses
import glob
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


@dataclass
class Config:
    # model
    d_model: int = 2048
    n_layer: int = 24
    n_head: int = 16
    vocab: int = 50304
    seq_len: int = 2048
    # optimisation (tuned for 512 x 2048 = 1M tokens per step)
    global_batch_size: int = 512
    micro_batch_size: int = 4
    lr: float = 2e-4
    min_lr: float = 2e-5
    warmup_steps: int = 1430
    train_tokens: int = 300_000_000_000
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # parallel / io
    tp: int = 2
    data_dir: str = ""
    out_dir: str = ""
    ckpt_interval: int = 1000
    ac_every: int = 2  # checkpoint every n-th block


def parse_config() -> Config:
    cfg = Config()
    ap = argparse.ArgumentParser()
    for f in dataclasses.fields(cfg):
        ap.add_argument(f"--{f.name}", type=type(getattr(cfg, f.name)), default=getattr(cfg, f.name))
    return Config(**vars(ap.parse_args()))


def rotary(head_dim, n):
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    f = torch.outer(torch.arange(n).float(), inv)
    return torch.polar(torch.ones_like(f), f)


def apply_rotary(x, fc):
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(xc * fc[: x.size(1)][None, :, None, :]).flatten(3).type_as(x)


class SelfAttention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.hd = c.d_model // c.n_head
        self.query = nn.Linear(c.d_model, c.d_model)
        self.key = nn.Linear(c.d_model, c.d_model)
        self.value = nn.Linear(c.d_model, c.d_model)
        self.dense = nn.Linear(c.d_model, c.d_model)

    def forward(self, x, fc):
        B, T, _ = x.shape
        q = apply_rotary(self.query(x).view(B, T, -1, self.hd), fc).transpose(1, 2)
        k = apply_rotary(self.key(x).view(B, T, -1, self.hd), fc).transpose(1, 2)
        v = self.value(x).view(B, T, -1, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(o.transpose(1, 2).reshape(B, T, -1))


class NeoXLayer(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.ln_attn = nn.LayerNorm(c.d_model)
        self.ln_mlp = nn.LayerNorm(c.d_model)
        self.attn = SelfAttention(c)
        self.mlp_in = nn.Linear(c.d_model, 4 * c.d_model)
        self.mlp_out = nn.Linear(4 * c.d_model, c.d_model)

    def forward(self, x, fc):
        # parallel residual, as in GPT-NeoX
        return x + self.attn(self.ln_attn(x), fc) + self.mlp_out(F.gelu(self.mlp_in(self.ln_mlp(x))))


class NeoX(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.d_model)
        self.layers = nn.ModuleList(NeoXLayer(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        self.register_buffer("fc", rotary(c.d_model // c.n_head, c.seq_len), persistent=False)

    @torch.no_grad()
    def reset_parameters(self):
        self.fc = rotary(self.c.d_model // self.c.n_head, self.c.seq_len).to(self.embed.weight.device)
        small = (2 / (5 * self.c.d_model)) ** 0.5
        wang = 2 / self.c.n_layer / self.c.d_model ** 0.5
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=wang if name.endswith(("dense", "mlp_out")) else small)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                m.reset_parameters()
        nn.init.normal_(self.embed.weight, std=small)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x, self.fc)
        return self.head(self.ln_f(x))


def apply_parallelism(model: NeoX, mesh, c: Config):
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    parallelize_module(model, tp_mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "ln_f": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for i, layer in enumerate(model.layers):
        parallelize_module(layer, tp_mesh, {
            "ln_attn": SequenceParallel(),
            "ln_mlp": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attn.query": ColwiseParallel(),
            "attn.key": ColwiseParallel(),
            "attn.value": ColwiseParallel(),
            "attn.dense": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_in": ColwiseParallel(input_layouts=Shard(1)),
            "mlp_out": RowwiseParallel(output_layouts=Shard(1)),
        })
        if i % c.ac_every == 0:
            layer = checkpoint_wrapper(layer, preserve_rng_state=False)
        model.layers[i] = torch.compile(layer)

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)


class ShardedTokens:
    """Random windows from uint16 shards. Every dp rank draws its own windows."""

    def __init__(self, data_dir, seq_len, micro_bs, dp_rank, seed):
        self.shards = [np.memmap(p, dtype=np.uint16, mode="r") for p in sorted(glob.glob(f"{data_dir}/*.bin"))]
        self.seq_len, self.bs = seq_len, micro_bs
        self.g = np.random.default_rng(seed + 7919 * dp_rank)

    def next(self):
        xs = []
        for _ in range(self.bs):
            arr = self.shards[self.g.integers(len(self.shards))]
            i = self.g.integers(0, len(arr) - self.seq_len - 1)
            xs.append(torch.from_numpy(arr[i : i + self.seq_len + 1].astype(np.int64)))
        b = torch.stack(xs).pin_memory()
        return b[:, :-1].cuda(non_blocking=True), b[:, 1:].cuda(non_blocking=True)


def main():
    c = parse_config()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cuda", (world // c.tp, c.tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    master = rank == 0

    torch.manual_seed(0)
    with torch.device("meta"):
        model = NeoX(c)
    apply_parallelism(model, mesh, c)
    model.to_empty(device="cuda")
    model.reset_parameters()

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": c.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=c.lr, betas=(0.9, 0.95), eps=1e-8)

    grad_accum = c.global_batch_size // c.micro_batch_size
    tokens_per_step = c.global_batch_size * c.seq_len
    max_steps = c.train_tokens // tokens_per_step

    def lr_at(it):
        if it < c.warmup_steps:
            return c.lr * (it + 1) / c.warmup_steps
        r = min(1.0, (it - c.warmup_steps) / (max_steps - c.warmup_steps))
        return c.min_lr + 0.5 * (1 + math.cos(math.pi * r)) * (c.lr - c.min_lr)

    step = 0
    ckpt_dir = os.path.join(c.out_dir, "checkpoints")
    if os.path.exists(os.path.join(ckpt_dir, "latest")):
        with open(os.path.join(ckpt_dir, "latest")) as f:
            tag = f.read().strip()
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd, "step": torch.zeros((), dtype=torch.long)}
        dcp.load(sd, checkpoint_id=os.path.join(ckpt_dir, tag))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        step = int(sd["step"])
        if master:
            print(f"resumed {tag} at step {step}")

    data = ShardedTokens(c.data_dir, c.seq_len, c.micro_batch_size, dp_rank, seed=step)
    inflight = None
    t0 = time.time()
    while step < max_steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss_acc = torch.zeros((), device="cuda")
        for micro in range(grad_accum):
            x, y = data.next()
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()) / grad_accum
            loss.backward()
            loss_acc += loss.detach()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        if step % 10 == 0:
            dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
            gnorm = gnorm.full_tensor().item()
            if master:
                dt = (time.time() - t0) / 10
                print(f"step {step}/{max_steps} loss {loss_acc.item():.4f} lr {lr_at(step):.2e} "
                      f"gnorm {gnorm:.3f} {tokens_per_step / dt / 1e6:.2f}M tok/s", flush=True)
            t0 = time.time()

        if step % c.ckpt_interval == 0:
            if inflight is not None:
                inflight.result()
            msd, osd = get_state_dict(model, opt)
            tag = f"step_{step:07d}"
            inflight = dcp.async_save({"model": msd, "optim": osd, "step": torch.tensor(step)},
                                      checkpoint_id=os.path.join(ckpt_dir, tag))
            if master:
                # point "latest" at the previous checkpoint, which is complete by now
                prev = f"step_{step - c.ckpt_interval:07d}"
                if os.path.exists(os.path.join(ckpt_dir, prev, ".metadata")):
                    with open(os.path.join(ckpt_dir, "latest"), "w") as f:
                        f.write(prev)

    if inflight is not None:
        inflight.result()
    dist.barrier()
    last = f"step_{step - step % c.ckpt_interval:07d}"
    if master and os.path.exists(os.path.join(ckpt_dir, last, ".metadata")):
        with open(os.path.join(ckpt_dir, "latest"), "w") as f:
            f.write(last)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
