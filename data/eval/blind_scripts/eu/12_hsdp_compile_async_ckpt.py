"""Multi-node pretraining with FSDP2 in HSDP mode (shard inside a node, replicate across nodes).

Per-block torch.compile, gradient accumulation without intra-step syncs, and
async DCP checkpoints staged through a gloo group.

    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    srun --nodes=4 --ntasks-per-node=1 torchrun --nnodes=4 --nproc_per_node=8 \
        --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 --rdzv_id=$SLURM_JOB_ID \
        12_hsdp_compile_async_ckpt.py --config /shared/configs/lm_2b.json
"""
import argparse
import json
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, Dataset, DistributedSampler


@dataclass
class Cfg:
    data: str = "/shared/tok/dclm_baseline/train.bin"
    ckpt: str = "/shared/ckpt/lm_2b"
    vocab: int = 100352
    dim: int = 2304
    layers: int = 26
    heads: int = 18
    seq: int = 4096
    micro_bs: int = 2
    accum: int = 4
    lr: float = 3e-4
    warmup: int = 2000
    steps: int = 50000
    wd: float = 0.1
    clip: float = 1.0
    ckpt_every: int = 1000
    compile: bool = True
    betas: list = field(default_factory=lambda: [0.9, 0.95])


class SwiGLUBlock(nn.Module):
    def __init__(self, c: Cfg):
        super().__init__()
        self.h = c.heads
        self.norm1 = nn.RMSNorm(c.dim, eps=1e-6)
        self.wqkv = nn.Linear(c.dim, 3 * c.dim, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)
        self.norm2 = nn.RMSNorm(c.dim, eps=1e-6)
        hidden = int(8 * c.dim / 3 / 64) * 64
        self.w12 = nn.Linear(c.dim, 2 * hidden, bias=False)
        self.w3 = nn.Linear(hidden, c.dim, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        qkv = self.wqkv(self.norm1(x)).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(B, T, D))
        g, u = self.w12(self.norm2(x)).chunk(2, dim=-1)
        return x + self.w3(F.silu(g) * u)


class LM(nn.Module):
    def __init__(self, c: Cfg):
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.pos = nn.Embedding(c.seq, c.dim)
        self.layers = nn.ModuleList([SwiGLUBlock(c) for _ in range(c.layers)])
        self.norm = nn.RMSNorm(c.dim, eps=1e-6)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)

    def init_weights(self):
        with torch.no_grad():
            for n, p in self.named_parameters():
                if "norm" in n:
                    p.fill_(1.0)
                else:
                    nn.init.trunc_normal_(p, std=0.02, a=-0.06, b=0.06)

    def forward(self, ids):
        h = self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


class Bin(Dataset):
    def __init__(self, path, seq):
        self.m = np.memmap(path, dtype=np.uint32, mode="r")
        self.seq = seq

    def __len__(self):
        return (len(self.m) - 1) // self.seq

    def __getitem__(self, i):
        t = torch.from_numpy(self.m[i * self.seq:(i + 1) * self.seq + 1].astype(np.int64))
        return t[:-1], t[1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config")
    a = ap.parse_args()
    c = Cfg()
    if a.config:
        with open(a.config) as f:
            c = Cfg(**{**c.__dict__, **json.load(f)})

    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="cpu:gloo,cuda:nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    assert world % local_world == 0
    # replicate across nodes, shard within a node (NVLink domain)
    mesh = init_device_mesh("cuda", (world // local_world, local_world), mesh_dim_names=("replicate", "shard"))
    ckpt_pg = dist.new_group(backend="gloo")

    torch.manual_seed(0)
    with torch.device("meta"):
        model = LM(c)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, layer in enumerate(model.layers):
        if c.compile:
            layer = torch.compile(layer)
            model.layers[i] = layer
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=dev)
    model.init_weights()

    opt = torch.optim.AdamW(model.parameters(), lr=c.lr, betas=tuple(c.betas), weight_decay=c.wd, fused=True)

    ds = Bin(c.data, c.seq)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=c.micro_bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    step = 0
    marker = os.path.join(c.ckpt, "LATEST")
    if os.path.exists(marker):
        with open(marker) as f:
            step = int(f.read().strip())
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=os.path.join(c.ckpt, f"step_{step:06d}"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def lr_at(s):
        if s < c.warmup:
            return c.lr * (s + 1) / c.warmup
        return 0.1 * c.lr + 0.9 * c.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - c.warmup) / (c.steps - c.warmup))))

    per_epoch = len(loader) // c.accum
    epoch = step // per_epoch
    sampler.set_epoch(epoch)
    it = iter(loader)
    for _ in range((step % per_epoch) * c.accum):
        next(it)

    pending = None
    pending_step = None
    model.train()
    t0 = time.time()
    while step < c.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss_sum = torch.zeros((), device=dev)
        for micro in range(c.accum):
            try:
                x, y = next(it)
            except StopIteration:
                epoch += 1
                sampler.set_epoch(epoch)
                it = iter(loader)
                x, y = next(it)
            is_last = micro == c.accum - 1
            model.set_requires_gradient_sync(is_last)
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            (loss / c.accum).backward()
            loss_sum += loss.detach() / c.accum
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), c.clip).full_tensor()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        if step % 10 == 0:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
            if rank == 0:
                tok_s = 10 * c.micro_bs * c.accum * c.seq * world / (time.time() - t0)
                print(f"step {step} loss {loss_sum.item():.4f} gnorm {gnorm.item():.3f} "
                      f"lr {lr_at(step):.2e} {tok_s / 1e6:.2f}M tok/s", flush=True)
            t0 = time.time()

        if step % c.ckpt_every == 0 or step == c.steps:
            if pending is not None:
                pending.result()
                if rank == 0:
                    with open(marker, "w") as f:
                        f.write(str(pending_step))
            msd, osd = get_state_dict(model, opt)
            pending = dcp.async_save({"model": msd, "optim": osd},
                                     checkpoint_id=os.path.join(c.ckpt, f"step_{step:06d}"),
                                     process_group=ckpt_pg)
            pending_step = step

    if pending is not None:
        pending.result()
        if rank == 0:
            with open(marker, "w") as f:
                f.write(str(pending_step))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
