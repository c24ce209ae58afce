"""~750M music LM over delayed EnCodec codebooks, conditioned on a CLAP embedding prefix.
Sharded with FSDP (FULL_SHARD, bf16 params/compute), activation checkpointing per block.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        10_musicgen_large_fsdp.py --shards /fsx/music/codes_clap --out /fsx/exp/mg_medium
"""
import argparse
import functools
import glob
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


CARD = 2048


class ClapCodes(Dataset):
    """Each shard .npz holds `codes` [N, 4, T] int16 and `clap` [N, 512] float16."""

    def __init__(self, shard_dir, frames):
        self.codes, self.clap = [], []
        for path in sorted(glob.glob(os.path.join(shard_dir, "*.npz"))):
            z = np.load(path)
            self.codes.append(z["codes"])
            self.clap.append(z["clap"])
        self.codes, self.clap = np.concatenate(self.codes), np.concatenate(self.clap)
        self.frames = frames

    def __len__(self):
        return len(self.codes)

    def __getitem__(self, i):
        c = self.codes[i]
        s = random.randint(0, c.shape[-1] - self.frames)
        return (torch.from_numpy(c[:, s : s + self.frames].astype(np.int64)),
                torch.from_numpy(self.clap[i].astype(np.float32)))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.o = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.GELU(), nn.Linear(4 * dim, dim, bias=False))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.ff(self.n2(x))


class MusicLM(nn.Module):
    def __init__(self, n_q=4, card=CARD, dim=1536, heads=24, layers=24, max_len=2048, clap_dim=512):
        super().__init__()
        self.n_q, self.card = n_q, card
        self.cond = nn.Linear(clap_dim, dim)
        self.emb = nn.ModuleList(nn.Embedding(card + 1, dim) for _ in range(n_q))
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.heads = nn.ModuleList(nn.Linear(dim, card, bias=False) for _ in range(n_q))

    def forward(self, tokens, clap):
        x = sum(e(tokens[:, k]) for k, e in enumerate(self.emb))
        x = torch.cat([self.cond(clap)[:, None], x], 1)
        x = x + self.pos.weight[: x.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x[:, :-1])
        return torch.stack([h(x) for h in self.heads], 1)


def delay(codes, card):
    b, k, t = codes.shape
    out = codes.new_full((b, k, t + k - 1), card)
    for q in range(k):
        out[:, q, q : q + t] = codes[:, q]
    return out


def save_checkpoint(model, optimizer, step, path, rank):
    if rank == 0:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                                  FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            model_state = model.state_dict()
            optim_state = FSDP.optim_state_dict(model, optimizer)
        torch.save({"model": model_state, "optim": optim_state, "step": step}, path + ".tmp")
        os.replace(path + ".tmp", path)
        print(f"saved {path}", flush=True)
    dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--frames", type=int, default=1500)
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=5000)
    ap.add_argument("--steps", type=int, default=500_000)
    ap.add_argument("--save-every", type=int, default=2000)
    ap.add_argument("--cond-drop", type=float, default=0.2)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)

    ds = ClapCodes(args.shards, args.frames)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.global_batch // world, sampler=sampler, num_workers=4,
                    pin_memory=True, drop_last=True)

    model = MusicLM()
    ckpt_path = os.path.join(args.out, "last.pt")
    resume = torch.load(ckpt_path, map_location="cpu", mmap=True) if os.path.exists(ckpt_path) else None
    if resume is not None:
        model.load_state_dict(resume["model"])

    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDP(model, auto_wrap_policy=wrap, sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                                buffer_dtype=torch.bfloat16),
                 device_id=local_rank, sync_module_states=True, use_orig_params=True)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, Block))

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    step = 0
    if resume is not None:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=False),
                                  FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False)):
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, resume["optim"]))
        step = resume["step"]
        del resume

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    epoch = step // len(dl)
    t0 = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for codes, clap in dl:
            codes = codes.to(device, non_blocking=True)
            clap = clap.to(device, non_blocking=True)
            keep = (torch.rand(clap.shape[0], 1, device=clap.device) >= args.cond_drop).float()
            clap = clap * keep
            tokens = delay(codes, CARD)

            lr = args.lr * min(1.0, (step + 1) / args.warmup)
            lr *= 0.5 * (1 + math.cos(math.pi * min(1.0, step / args.steps)))
            for g in opt.param_groups:
                g["lr"] = lr
            logits = model(tokens, clap)  # the CLAP prefix acts as BOS
            loss = F.cross_entropy(logits.float().flatten(0, 2), tokens.flatten(), ignore_index=CARD)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = model.clip_grad_norm_(1.0)
            opt.step()
            step += 1

            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} gnorm {gnorm.item():.3f} lr {lr:.2e} "
                          f"{(time.time() - t0) / 50:.2f}s/it", flush=True)
                t0 = time.time()
            if step % args.save_every == 0:
                save_checkpoint(model, opt, step, ckpt_path, rank)
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
