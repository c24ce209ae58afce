"""Stereo music LM (8 codebooks: 4 left + 4 right, delay pattern), ~1B params, FSDP.

Resumable sharded checkpoints go through torch.distributed.checkpoint; every N steps
we also export a consolidated fp32 state dict for the inference team.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        17_stereo_musiclm_fsdp_dcp.py --data /fsx/music/stereo_codes --out /fsx/exp/stereo_lm_1b
"""
import argparse
import functools
import json
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
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_Q, CARD = 8, 2048


class StereoWindows(Dataset):
    def __init__(self, root, split, frames):
        with open(os.path.join(root, f"{split}.json")) as f:
            self.items = json.load(f)  # [{"file": ..., "frames": ...}]
        self.items = [it for it in self.items if it["frames"] >= frames]
        self.root, self.frames, self.train = root, frames, split == "train"

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        codes = np.load(os.path.join(self.root, it["file"]), mmap_mode="r")  # [8, T]
        s = random.randint(0, it["frames"] - self.frames) if self.train else 0
        return torch.from_numpy(np.array(codes[:, s : s + self.frames], dtype=np.int64))


class DecoderBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1, self.w2, self.w3 = (nn.Linear(dim, 8 * dim // 3, bias=False), nn.Linear(8 * dim // 3, dim, bias=False),
                                     nn.Linear(dim, 8 * dim // 3, bias=False))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.wqkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        h = self.ln2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class StereoLM(nn.Module):
    def __init__(self, dim=1536, heads=24, layers=32, max_len=2048):
        super().__init__()
        self.emb = nn.ModuleList(nn.Embedding(CARD + 1, dim) for _ in range(N_Q))
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(DecoderBlock(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.out = nn.ModuleList(nn.Linear(dim, CARD, bias=False) for _ in range(N_Q))

    def forward(self, tokens):
        h = sum(e(tokens[:, k]) for k, e in enumerate(self.emb)) + self.pos.weight[: tokens.shape[-1]]
        for blk in self.blocks:
            h = blk(h)
        h = self.ln(h)
        return torch.stack([o(h) for o in self.out], 1)


def delay_io(codes):
    b, k, t = codes.shape
    d = codes.new_full((b, k, t + k), CARD)
    for q in range(k):
        d[:, q, q + 1 : q + 1 + t] = codes[:, q]
    return d[..., :-1], d[..., 1:]


def save_sharded(model, optim, step, out):
    path = os.path.join(out, f"step_{step:08d}")
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp.save(state, checkpoint_id=path)
    if dist.get_rank() == 0:
        with open(os.path.join(out, "latest.json"), "w") as f:
            json.dump({"step": step, "path": path}, f)
    dist.barrier()


def load_sharded(model, optim, path):
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        optim_state = load_sharded_optimizer_state_dict(
            model_state_dict=state["model"], optimizer_key="optim", storage_reader=dcp.FileSystemReader(path))
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, optim_state["optim"]))


def export_consolidated(model, path):
    # all ranks take part in gathering the full weights; only rank 0 receives and writes them
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
    if dist.get_rank() == 0:
        torch.save(state, path)
    dist.barrier()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for codes in loader:
        inp, tgt = delay_io(codes.to(device))
        logits = model(inp)
        acc[0] += F.cross_entropy(logits.float().flatten(0, 2), tgt.flatten(), ignore_index=CARD, reduction="sum")
        acc[1] += (tgt != CARD).sum()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--frames", type=int, default=1500)
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1.5e-4)
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=300_000)
    ap.add_argument("--ckpt-every", type=int, default=1000)
    ap.add_argument("--export-every", type=int, default=20_000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)

    train_ds = StereoWindows(args.data, "train", args.frames)
    valid_ds = StereoWindows(args.data, "valid", args.frames)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    per_gpu = args.global_batch // world
    dl = DataLoader(train_ds, per_gpu, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)
    # FSDP forward is collective: every rank must see the same number of validation batches
    vdl = DataLoader(valid_ds, per_gpu, sampler=DistributedSampler(valid_ds, shuffle=False, drop_last=True),
                     drop_last=True, num_workers=2)

    model = FSDP(
        StereoLM(),
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={DecoderBlock}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        device_id=local_rank,
        sync_module_states=True,
        limit_all_gathers=True,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, DecoderBlock),
    )
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    step = 0
    latest = os.path.join(args.out, "latest.json")
    if os.path.exists(latest):
        with open(latest) as f:
            meta = json.load(f)
        load_sharded(model, optim, meta["path"])
        step = meta["step"]
        if rank == 0:
            print(f"resumed from {meta['path']}", flush=True)
    elif rank == 0:
        os.makedirs(args.out, exist_ok=True)

    epoch, t0 = step // len(dl), time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for codes in dl:
            inp, tgt = delay_io(codes.to(device, non_blocking=True))
            lr = args.lr * min(1.0, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
            for g in optim.param_groups:
                g["lr"] = lr
            logits = model(inp)
            loss = F.cross_entropy(logits.float().flatten(0, 2), tgt.flatten(), ignore_index=CARD)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = model.clip_grad_norm_(1.0)
            optim.step()
            step += 1

            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} gnorm {gnorm.item():.2f} lr {lr:.2e} "
                          f"{(time.time() - t0) / 50:.2f}s/it", flush=True)
                t0 = time.time()
            if step % args.ckpt_every == 0:
                save_sharded(model, optim, step, args.out)
            if step % args.export_every == 0:
                val = validate(model, vdl, device)
                if rank == 0:
                    print(f"[valid] step {step} loss {val:.4f}", flush=True)
                export_consolidated(model, os.path.join(args.out, f"consolidated_{step:08d}.pt"))
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
