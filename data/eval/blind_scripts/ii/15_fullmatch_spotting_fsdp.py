"""Full-half context action spotting + ball-possession (team) tagging with FSDP.

Instead of short windows, the model attends over a whole 45-minute half at
2 fps (~5,400 tokens) of CLIP-L/14 frame features. The encoder is ~600M
parameters, so it is sharded with FSDP (bf16 compute, fp32 master weights) and
each transformer block is activation-checkpointed.

Heads (per frame):  17 event classes (sigmoid)  +  possession: home / away / dead ball.

    torchrun --nnodes=1 --nproc_per_node=8 15_fullmatch_spotting_fsdp.py --feat-root /data/sn/clip_l14_2fps
"""
import argparse
import functools
import json
import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

NUM_EVENTS = 17
POSSESSION = {"home": 0, "away": 1, "dead": 2}
FPS = 2


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--feat-root", type=Path, required=True)
    p.add_argument("--dim", type=int, default=1536)
    p.add_argument("--depth", type=int, default=20)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=1.5e-4, help="lr for 64 halves per step")
    p.add_argument("--tol-sec", type=float, default=5.0)
    p.add_argument("--ckpt", type=Path, default=Path("/checkpoints/fullmatch_fsdp/state.pt"))
    return p.parse_args()


class Halves(Dataset):
    """One item = one full half: feats (T, D), events (T, C), possession (T,) with -1 = unlabelled."""

    def __init__(self, root, games):
        self.files = [(root / g, h) for g in games for h in (1, 2)]

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        g, h = self.files[i]
        feats = np.load(g / f"{h}_clip_l14.npy").astype(np.float32)
        T = feats.shape[0]
        ev = np.zeros((T, NUM_EVENTS), np.float32)
        for c, f in np.load(g / f"{h}_events.npy"):
            ev[min(int(f), T - 1), int(c)] = 1.0
        poss = np.full(T, -1, np.int64)
        for seg in json.loads((g / f"{h}_possession.json").read_text()):
            poss[int(seg["start"] * FPS): int(seg["end"] * FPS)] = POSSESSION[seg["team"]]
        return torch.from_numpy(feats), torch.from_numpy(ev), torch.from_numpy(poss)


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, D)
        x = x + self.proj(a)
        return x + self.mlp(self.n2(x))


class FullMatchSpotter(nn.Module):
    def __init__(self, in_dim, dim, depth, heads):
        super().__init__()
        self.inp = nn.Linear(in_dim, dim)
        self.time = nn.Conv1d(dim, dim, 9, padding=4, groups=dim)   # relative position via depthwise conv
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.event_head = nn.Linear(dim, NUM_EVENTS)
        self.poss_head = nn.Linear(dim, len(POSSESSION))

    def forward(self, x):
        h = self.inp(x)
        h = h + self.time(h.transpose(1, 2)).transpose(1, 2)
        for blk in self.blocks:
            h = blk(h)
        h = self.norm(h)
        return self.event_head(h), self.poss_head(h)


def spotting_counts(ev_logits, ev_gt, tol):
    """Greedy per-class matching of local maxima (> 0.5) to ground truth within +-tol frames."""
    s = ev_logits.float().sigmoid()
    peaks = (s == F.max_pool1d(s.T[None], 2 * tol + 1, 1, tol)[0].T) & (s > 0.5)
    c = torch.zeros(3, device=s.device)   # tp, fp, fn
    for k in range(NUM_EVENTS):
        p = torch.nonzero(peaks[:, k]).flatten()
        g = torch.nonzero(ev_gt[:, k] > 0).flatten()
        if len(g) and len(p):
            d = (p[:, None] - g[None]).abs()
            tp = int((d.min(0).values <= tol).sum())
        else:
            tp = 0
        c += torch.tensor([tp, len(p) - tp, len(g) - tp], device=s.device, dtype=torch.float)
    return c


def save_checkpoint(model, optim, sched, epoch, path, rank):
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                              FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        model_sd = model.state_dict()
        optim_sd = FSDP.optim_state_dict(model, optim)
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model_sd, "optim": optim_sd, "sched": sched.state_dict(), "epoch": epoch},
                   str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)
    dist.barrier()


def load_checkpoint(model, optim, sched, path):
    ckpt = torch.load(path, map_location="cpu")
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=False),
                              FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False)):
        model.load_state_dict(ckpt["model"])
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, ckpt["optim"]))
    sched.load_state_dict(ckpt["sched"])
    return ckpt["epoch"] + 1


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    split = json.loads((args.feat_root / "splits.json").read_text())
    train_ds, val_ds = Halves(args.feat_root, split["train"]), Halves(args.feat_root, split["valid"])
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    # one half per GPU per step; halves differ in length, so no batching across halves
    train_dl = DataLoader(train_ds, batch_size=1, sampler=sampler, num_workers=4, pin_memory=True)
    # FSDP needs every rank in every forward: pad the val shard to equal length and mask the repeats
    per_rank = math.ceil(len(val_ds) / world)
    val_idx = [(i if i < len(val_ds) else i % len(val_ds), i < len(val_ds))
               for i in range(rank * per_rank, (rank + 1) * per_rank)]

    in_dim = train_ds[0][0].shape[1]
    model = FullMatchSpotter(in_dim, args.dim, args.depth, args.heads)
    model = FSDP(model,
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.bfloat16),
                 sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=local_rank, use_orig_params=True,
                 limit_all_gathers=True)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, Block))

    lr = args.lr * world / 64
    optim = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    steps = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=lr, total_steps=steps, pct_start=0.05)
    start_epoch = load_checkpoint(model, optim, sched, args.ckpt) if args.ckpt.exists() else 0
    if rank == 0:
        print(f"{len(train_ds)} train halves, {len(val_ds)} val halves, lr {lr:.2e}, start epoch {start_epoch}",
              flush=True)

    tol = int(args.tol_sec * FPS)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        run = torch.zeros(2, device=device)
        for feats, ev, poss in train_dl:
            feats, ev, poss = feats.to(device), ev.to(device), poss.to(device)
            ev_logits, poss_logits = model(feats)
            loss_ev = F.binary_cross_entropy_with_logits(ev_logits.float(), ev, pos_weight=torch.tensor(20.0, device=device))
            loss_poss = F.cross_entropy(poss_logits.float().flatten(0, 1), poss.flatten(), ignore_index=-1)
            loss = loss_ev + 0.3 * torch.nan_to_num(loss_poss)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)

        model.eval()
        counts = torch.zeros(3, device=device)
        poss_acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for i, valid in val_idx:
                feats, ev, poss = (t.to(device) for t in val_ds[i])
                ev_logits, poss_logits = model(feats[None])
                if not valid:
                    continue
                counts += spotting_counts(ev_logits[0], ev, tol)
                m = poss >= 0
                poss_acc += torch.stack([(poss_logits[0].argmax(-1)[m] == poss[m]).sum().float(), m.sum().float()])
        dist.all_reduce(counts)
        dist.all_reduce(poss_acc)
        tp, fp, fn = counts.tolist()
        f1 = 2 * tp / max(2 * tp + fp + fn, 1)
        if rank == 0:
            print(f"epoch {epoch}: loss {(run[0] / run[1]).item():.4f} spotting F1@{args.tol_sec:g}s {f1:.4f} "
                  f"possession acc {(poss_acc[0] / poss_acc[1].clamp(min=1)).item():.4f}", flush=True)
        save_checkpoint(model, optim, sched, epoch, args.ckpt, rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
