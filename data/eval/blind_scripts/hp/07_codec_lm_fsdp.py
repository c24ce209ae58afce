#!/usr/bin/env python3
"""1.3B codec-token LM (DAC 44.1 kHz, 9 codebooks, delay pattern) trained with FSDP.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        07_codec_lm_fsdp.py --data /shared/dac_codes --out /shared/runs/dac_lm_1b3
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
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_Q, CARD = 9, 1024
SPECIAL = CARD  # pad / not-yet-started value in every codebook


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True, bias=False)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.GELU(), nn.Linear(4 * dim, dim, bias=False))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)[0]
        return x + self.mlp(self.ln2(x))


class DACLM(nn.Module):
    def __init__(self, dim=2048, depth=24, heads=16, max_len=2048):
        super().__init__()
        self.emb = nn.ModuleList(nn.Embedding(CARD + 1, dim) for _ in range(N_Q))
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.heads = nn.ModuleList(nn.Linear(dim, CARD, bias=False) for _ in range(N_Q))

    def forward(self, codes):  # [B, N_Q, T]
        T = codes.size(-1)
        x = sum(e(codes[:, k]) for k, e in enumerate(self.emb)) + self.pos.weight[:T]
        mask = torch.ones(T, T, dtype=torch.bool, device=codes.device).triu(1)
        for blk in self.blocks:
            x = blk(x, mask)
        x = self.ln_f(x)
        return torch.stack([h(x) for h in self.heads], 1)  # [B, N_Q, T, CARD]


def apply_delay(codes):
    K, T = codes.shape
    out = np.full((K, T + K), SPECIAL, dtype=np.int64)
    for k in range(K):
        out[k, k + 1:k + 1 + T] = codes[k]
    return out


class DACChunks(Dataset):
    def __init__(self, files, frames, train):
        self.files, self.frames, self.train = files, frames, train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        c = np.load(self.files[i], mmap_mode="r")
        T = c.shape[1]
        s = np.random.randint(0, max(1, T - self.frames + 1)) if self.train else 0
        seg = np.full((N_Q, self.frames), SPECIAL, dtype=np.int64)
        chunk = np.asarray(c[:N_Q, s:s + self.frames])
        seg[:, :chunk.shape[1]] = chunk
        return torch.from_numpy(apply_delay(seg))


def loss_fn(logits, codes):
    inp_tgt = codes[:, :, 1:]
    return F.cross_entropy(logits.float().reshape(-1, CARD), inp_tgt.reshape(-1), ignore_index=SPECIAL,
                           reduction="sum"), (inp_tgt != SPECIAL).sum()


def save_model(model, path, rank):
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        torch.save(state, path)
        print(f"saved {path}", flush=True)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for codes in loader:
        codes = codes.to(device, non_blocking=True)
        s, n = loss_fn(model(codes[:, :, :-1]), codes)
        tot[0] += s
        tot[1] += n
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--frames", type=int, default=1720, help="~20 s at 86 Hz")
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--grad_accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=150_000)
    ap.add_argument("--save_every", type=int, default=5000)
    ap.add_argument("--eval_every", type=int, default=2500)
    ap.add_argument("--init_from", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_files = sorted(glob.glob(os.path.join(args.data, "train", "**", "*.npy"), recursive=True))
    val_files = sorted(glob.glob(os.path.join(args.data, "val", "**", "*.npy"), recursive=True))
    train_ds = DACChunks(train_files, args.frames, train=True)
    val_ds = DACChunks(val_files, args.frames, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    # drop_last keeps the same number of eval batches on every rank (each forward all-gathers)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, args.batch_size, sampler=val_sampler, num_workers=4, drop_last=True)

    model = DACLM(max_len=args.frames + N_Q)
    if args.init_from:
        model.load_state_dict(torch.load(args.init_from, map_location="cpu"))
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=local_rank,
        limit_all_gathers=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters()) * world
        print(f"~{n_params / 1e9:.2f}B params, world {world}", flush=True)

    step, epoch, micro = 0, 0, 0
    t0 = time.time()
    while step < args.steps:
        train_sampler.set_epoch(epoch)
        for codes in train_dl:
            codes = codes.to(device, non_blocking=True)
            s, n = loss_fn(model(codes[:, :, :-1]), codes)
            loss = s / n.clamp(min=1)
            (loss / args.grad_accum).backward()
            micro += 1
            if micro % args.grad_accum:
                continue
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 50 == 0:
                print(f"step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / 50:.2f}s/step", flush=True)
                t0 = time.time()
            if step % args.eval_every == 0:
                v = evaluate(model, val_dl, device)
                if rank == 0:
                    print(f"step {step} val {v:.4f}", flush=True)
            if step % args.save_every == 0:
                save_model(model, os.path.join(args.out, f"model_{step:07d}.pt"), rank)
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    save_model(model, os.path.join(args.out, "model_final.pt"), rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
