"""Preemption-tolerant LM pretraining on the spot pool with FSDP1.

Nodes in the spot pool get reclaimed; the job runs under elastic torchrun and
restarts from the newest checkpoint with whatever nodes are left. Checkpoints
are written as one file per rank (no gather, no coordination) so that saving
every few minutes is cheap.

    torchrun --nnodes=1:4 --nproc_per_node=8 --max-restarts=20 \
        --rdzv_backend=c10d --rdzv_endpoint=$RDZV_HOST:29400 --rdzv_id=$JOB_ID \
        20_elastic_fsdp1_local_ckpt.py --ckpt-dir /efs/ckpt/lm-1b-spot
"""
import argparse
import functools
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import LocalStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/efs/data/redpajama_sample_gpt2.bin")
    p.add_argument("--ckpt-dir", default="/efs/ckpt/lm-1b-spot")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mbs", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--ckpt-every", type=int, default=200)
    return p.parse_args()


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, d, layers, h, seq):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        for n, p in self.named_parameters():
            if p.ndim == 2:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * layers) if n.endswith(("proj.weight", "fc2.weight")) else 1))

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


class Bin(Dataset):
    def __init__(self, path, seq):
        self.a = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq = seq

    def __len__(self):
        return (len(self.a) - 1) // self.seq

    def __getitem__(self, i):
        t = torch.from_numpy(self.a[i * self.seq:(i + 1) * self.seq + 1].astype(np.int64))
        return t[:-1], t[1:]


def ckpt_name(ckpt_dir, step, rank):
    return os.path.join(ckpt_dir, f"step_{step:07d}", f"rank_{rank:05d}.pt")


def save_local(model, optim, step, args, rank):
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT, LocalStateDictConfig(offload_to_cpu=True)):
        payload = {"model": model.state_dict(), "optim": optim.state_dict(), "step": step}
    path = ckpt_name(args.ckpt_dir, step, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(payload, path + ".tmp")
    os.replace(path + ".tmp", path)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(args.ckpt_dir, "COMPLETE"), "w") as f:
            f.write(str(step))


def load_latest(model, optim, args, rank):
    marker = os.path.join(args.ckpt_dir, "COMPLETE")
    if not os.path.exists(marker):
        return 0
    with open(marker) as f:
        step = int(f.read())
    payload = torch.load(ckpt_name(args.ckpt_dir, step, rank), map_location="cpu", weights_only=False)
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        model.load_state_dict(payload["model"])
    optim.load_state_dict(payload["optim"])
    return payload["step"]


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))

    torch.manual_seed(0)
    model = GPT(50304, args.dim, args.layers, args.heads, args.seq)
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=dev,
        limit_all_gathers=True,
    )
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    step = load_latest(model, optim, args, rank)
    if rank == 0:
        print(f"world={world} restart={restart} starting at step {step}", flush=True)

    ds = Bin(args.data, args.seq)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=args.mbs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    def lr_at(s):
        if s < args.warmup:
            return args.lr * (s + 1) / args.warmup
        return args.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - args.warmup) / (args.steps - args.warmup))))

    # new epoch boundary on every restart keeps the data order deterministic enough for spot runs
    epoch = step // len(loader) + restart
    sampler.set_epoch(epoch)
    it = iter(loader)
    model.train()
    t0 = time.time()
    while step < args.steps:
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            it = iter(loader)
            x, y = next(it)
        for g in optim.param_groups:
            g["lr"] = lr_at(step)
        loss = F.cross_entropy(model(x.to(dev, non_blocking=True)).float().flatten(0, 1),
                               y.to(dev, non_blocking=True).flatten())
        loss.backward()
        model.clip_grad_norm_(1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        step += 1

        if step % 20 == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step} loss {l.item():.4f} lr {lr_at(step):.2e} {(time.time() - t0) / 20:.3f}s/it",
                      flush=True)
            t0 = time.time()
        if step % args.ckpt_every == 0:
            save_local(model, optim, step, args, rank)
            if rank == 0:
                for old in sorted(glob.glob(os.path.join(args.ckpt_dir, "step_*")))[:-2]:
                    for f in glob.glob(os.path.join(old, "*.pt")):
                        os.remove(f)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
