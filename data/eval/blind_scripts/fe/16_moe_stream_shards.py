#!/usr/bin/env python
"""MoE decoder pre-training streaming pre-tokenized shards (one .npy per crawl dump).

Shards are assigned round-robin to ranks so no rank ever opens a file another
rank reads; experts are split over --ep-size ranks.

    deepspeed --num_gpus 8 16_moe_stream_shards.py --deepspeed --deepspeed_config configs/moe_stream.json \
        --train-shards "/shared/tok/cc_*/shard_*.npy" --val-file /shared/tok/val.npy \
        --save /shared/exp/moe_stream
"""
import argparse
import glob
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import deepspeed
import deepspeed.comm as dist
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-shards", required=True)
    ap.add_argument("--val-file", required=True)
    ap.add_argument("--save", required=True)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--d", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--ep-size", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--aux", type=float, default=0.01)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--val-every", type=int, default=1000)
    ap.add_argument("--local_rank", type=int, default=-1)
    ap = deepspeed.add_config_arguments(ap)
    return ap.parse_args()


class ShardStream(IterableDataset):
    def __init__(self, files, seq, seed):
        self.files = files
        self.seq = seq
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        rng = np.random.default_rng(self.seed + self.epoch)
        order = rng.permutation(len(self.files))
        for j in order[wid::nw]:
            arr = np.load(self.files[j], mmap_mode="r")
            n = (len(arr) - 1) // self.seq
            for k in rng.permutation(n):
                w = torch.from_numpy(arr[k * self.seq:(k + 1) * self.seq + 1].astype(np.int64))
                yield w[:-1], w[1:]


class ValWindows(Dataset):
    def __init__(self, path, seq):
        self.arr = np.load(path, mmap_mode="r")
        self.seq = seq

    def __len__(self):
        return (len(self.arr) - 1) // self.seq

    def __getitem__(self, k):
        w = torch.from_numpy(self.arr[k * self.seq:(k + 1) * self.seq + 1].astype(np.int64))
        return w[:-1], w[1:]


class SwiGLU(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w12 = nn.Linear(d, 2 * h, bias=False)
        self.w3 = nn.Linear(h, d, bias=False)

    def forward(self, x):
        a, b = self.w12(x).chunk(2, -1)
        return self.w3(F.silu(a) * b)


class MoEDecoderLayer(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.heads = a.heads
        self.norm1 = nn.LayerNorm(a.d)
        self.qkv = nn.Linear(a.d, 3 * a.d, bias=False)
        self.proj = nn.Linear(a.d, a.d, bias=False)
        self.norm2 = nn.LayerNorm(a.d)
        self.moe = MoE(hidden_size=a.d, expert=SwiGLU(a.d, 2 * a.d), num_experts=a.experts,
                       ep_size=a.ep_size, k=a.topk, capacity_factor=1.25, eval_capacity_factor=2.0,
                       min_capacity=4, drop_tokens=True)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))
        y, l_aux, _ = self.moe(self.norm2(x))
        return x + y, l_aux


class MoEDecoder(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed = nn.Embedding(a.vocab, a.d)
        self.pos = nn.Embedding(a.seq, a.d)
        self.layers = nn.ModuleList([MoEDecoderLayer(a) for _ in range(a.layers)])
        self.norm = nn.LayerNorm(a.d)
        self.lm_head = nn.Linear(a.d, a.vocab, bias=False)

    def forward(self, x, y):
        h = self.embed(x) + self.pos(torch.arange(x.size(1), device=x.device))
        aux = 0.0
        for layer in self.layers:
            h, l_aux = layer(h)
            aux = aux + l_aux
        logits = self.lm_head(self.norm(h))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1)), aux / len(self.layers)


def main():
    args = parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    shards = sorted(glob.glob(args.train_shards))
    my_shards = shards[rank::world]
    train_stream = ShardStream(my_shards, args.seq, seed=rank)
    val_ds = ValWindows(args.val_file, args.seq)

    model = MoEDecoder(args)
    engine, _, _, _ = deepspeed.initialize(
        args=args, model=model,
        model_parameters=split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "params"}))
    mbs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()

    train_loader = DataLoader(train_stream, batch_size=mbs, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=mbs, drop_last=True,
                            sampler=DistributedSampler(val_ds, num_replicas=world, rank=rank,
                                                       shuffle=False, drop_last=True))

    if rank == 0:
        print(f"{len(shards)} shards over {world} ranks, experts={args.experts} ep={args.ep_size}")

    def validate(limit=50):
        engine.eval()
        s = torch.zeros(2, device=engine.device)
        with torch.no_grad():
            for i, (x, y) in enumerate(val_loader):
                if i == limit:
                    break
                loss, _ = engine(x.to(engine.device), y.to(engine.device))
                s += torch.stack([loss.float(), torch.ones((), device=engine.device)])
        dist.all_reduce(s)
        engine.train()
        return (s[0] / s[1]).item()

    micro = 0
    for epoch in range(args.epochs):
        train_stream.set_epoch(epoch)
        for x, y in train_loader:
            loss, aux = engine(x.to(engine.device, non_blocking=True), y.to(engine.device, non_blocking=True))
            engine.backward(loss + args.aux * aux)
            engine.step()
            micro += 1
            if micro % gas:
                continue
            step = engine.global_steps
            if step % 20 == 0:
                rep = torch.stack([loss.detach().float(), aux.detach().float()])
                dist.all_reduce(rep)
                rep /= world
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {rep[0]:.4f} aux {rep[1]:.4f} "
                          f"lr {engine.get_lr()[0]:.2e}", flush=True)
            if step % args.val_every == 0:
                vl = validate()
                if rank == 0:
                    print(f"step {step} val {vl:.4f} ppl {math.exp(vl):.1f}", flush=True)
                engine.save_checkpoint(args.save, tag=f"step{step}")

    engine.save_checkpoint(args.save, tag="final")
    dist.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
