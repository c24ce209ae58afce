#!/usr/bin/env python
"""
RWKV-6 style language model trained with truncated BPTT over long token streams.

Every sample is a contiguous stream of `stream_len` tokens. The stream is cut into
`chunk_len` pieces and the recurrent state (token-shift + WKV state of every layer)
is carried from one chunk into the next, detached at the chunk boundary.

    torchrun --nproc_per_node=8 01_rwkv6_tbptt.py --data /data/pile/train.bin --val_data /data/pile/val.bin
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

from fla.ops.rwkv6 import chunk_rwkv6


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", type=str, required=True, help="uint16 token file")
    p.add_argument("--val_data", type=str, required=True)
    p.add_argument("--vocab_size", type=int, default=65536)
    p.add_argument("--n_layer", type=int, default=12)
    p.add_argument("--d_model", type=int, default=768)
    p.add_argument("--head_size", type=int, default=64)
    p.add_argument("--stream_len", type=int, default=16384)
    p.add_argument("--chunk_len", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min_lr", type=float, default=6e-5)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--max_steps", type=int, default=20000)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--eval_every", type=int, default=1000)
    p.add_argument("--eval_streams", type=int, default=64)
    p.add_argument("--save_every", type=int, default=2000)
    p.add_argument("--out_dir", type=str, default="runs/rwkv6_tbptt")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


# ----------------------------------------------------------------------------- model

class TimeMix(nn.Module):
    def __init__(self, d_model, head_size, layer_id, n_layer):
        super().__init__()
        self.n_head = d_model // head_size
        self.head_size = head_size
        r01 = layer_id / max(n_layer - 1, 1)
        r10 = 1.0 - layer_id / n_layer
        ddd = torch.arange(d_model, dtype=torch.float32) / d_model
        self.mix_r = nn.Parameter(1.0 - torch.pow(ddd, 0.5 * r10))
        self.mix_k = nn.Parameter(1.0 - torch.pow(ddd, r10))
        self.mix_v = nn.Parameter(1.0 - (torch.pow(ddd, r10) + 0.3 * r01))
        self.mix_g = nn.Parameter(1.0 - torch.pow(ddd, 0.5 * r10))
        n = torch.arange(d_model, dtype=torch.float32)
        decay = -6 + 5 * (n / (d_model - 1)) ** (0.7 + 1.3 * r01)
        self.time_decay = nn.Parameter(decay.view(self.n_head, head_size))
        self.time_first = nn.Parameter(torch.full((self.n_head, head_size), 0.3))
        self.receptance = nn.Linear(d_model, d_model, bias=False)
        self.key = nn.Linear(d_model, d_model, bias=False)
        self.value = nn.Linear(d_model, d_model, bias=False)
        self.gate = nn.Linear(d_model, d_model, bias=False)
        self.output = nn.Linear(d_model, d_model, bias=False)
        self.ln_x = nn.GroupNorm(self.n_head, d_model, eps=64e-5)

    def forward(self, x, shift, wkv):
        B, T, C = x.shape
        H, K = self.n_head, self.head_size
        xx = torch.cat([shift.unsqueeze(1), x[:, :-1]], dim=1) - x
        r = self.receptance(x + xx * self.mix_r).view(B, T, H, K).transpose(1, 2)
        k = self.key(x + xx * self.mix_k).view(B, T, H, K).transpose(1, 2)
        v = self.value(x + xx * self.mix_v).view(B, T, H, K).transpose(1, 2)
        g = F.silu(self.gate(x + xx * self.mix_g))
        w = -torch.exp(self.time_decay.float()).view(1, H, 1, K).expand(B, H, T, K)
        o, wkv = chunk_rwkv6(r, k, v, w.to(r.dtype), self.time_first, scale=1.0,
                             initial_state=wkv, output_final_state=True)
        o = self.ln_x(o.transpose(1, 2).reshape(B * T, C)).view(B, T, C)
        return self.output(o * g), x[:, -1], wkv


class ChannelMix(nn.Module):
    def __init__(self, d_model, layer_id, n_layer):
        super().__init__()
        r10 = 1.0 - layer_id / n_layer
        ddd = torch.arange(d_model, dtype=torch.float32) / d_model
        self.mix_k = nn.Parameter(1.0 - torch.pow(ddd, r10))
        self.mix_r = nn.Parameter(1.0 - torch.pow(ddd, r10))
        self.key = nn.Linear(d_model, 4 * d_model, bias=False)
        self.receptance = nn.Linear(d_model, d_model, bias=False)
        self.value = nn.Linear(4 * d_model, d_model, bias=False)

    def forward(self, x, shift):
        xx = torch.cat([shift.unsqueeze(1), x[:, :-1]], dim=1) - x
        k = torch.relu(self.key(x + xx * self.mix_k)) ** 2
        return torch.sigmoid(self.receptance(x + xx * self.mix_r)) * self.value(k), x[:, -1]


class Block(nn.Module):
    def __init__(self, d_model, head_size, layer_id, n_layer):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.att = TimeMix(d_model, head_size, layer_id, n_layer)
        self.ffn = ChannelMix(d_model, layer_id, n_layer)

    def forward(self, x, state):
        att_shift, wkv, ffn_shift = state
        h, att_shift, wkv = self.att(self.ln1(x), att_shift, wkv)
        x = x + h
        h, ffn_shift = self.ffn(self.ln2(x), ffn_shift)
        return x + h, (att_shift, wkv, ffn_shift)


class RWKVLM(nn.Module):
    def __init__(self, vocab_size, d_model, n_layer, head_size):
        super().__init__()
        self.d_model, self.head_size = d_model, head_size
        self.emb = nn.Embedding(vocab_size, d_model)
        self.ln0 = nn.LayerNorm(d_model)
        self.blocks = nn.ModuleList([Block(d_model, head_size, i, n_layer) for i in range(n_layer)])
        self.ln_out = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        nn.init.uniform_(self.emb.weight, -1e-4, 1e-4)
        nn.init.orthogonal_(self.head.weight, gain=0.5)

    def init_state(self, batch_size, device):
        H = self.d_model // self.head_size
        state = []
        for _ in self.blocks:
            state.append((
                torch.zeros(batch_size, self.d_model, device=device),
                torch.zeros(batch_size, H, self.head_size, self.head_size, device=device),
                torch.zeros(batch_size, self.d_model, device=device),
            ))
        return state

    def forward(self, idx, state):
        x = self.ln0(self.emb(idx))
        new_state = []
        for block, s in zip(self.blocks, state):
            x, s = block(x, s)
            new_state.append(s)
        return self.head(self.ln_out(x)), new_state


def detach_state(state):
    return [tuple(t.detach() for t in s) for s in state]


# ----------------------------------------------------------------------------- data

class StreamDataset(Dataset):
    def __init__(self, path, stream_len):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.stream_len = stream_len
        self.n = (len(self.tokens) - 1) // stream_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        start = i * self.stream_len
        chunk = self.tokens[start:start + self.stream_len + 1].astype(np.int64)
        return torch.from_numpy(chunk)


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.max_steps - args.warmup))
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(raw_model, loader, args, device):
    raw_model.eval()
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    tok_sum = torch.zeros((), device=device, dtype=torch.float64)
    for batch in loader:
        batch = batch.to(device, non_blocking=True)
        state = raw_model.init_state(batch.size(0), device)
        for s in range(0, args.stream_len, args.chunk_len):
            x = batch[:, s:s + args.chunk_len]
            y = batch[:, s + 1:s + 1 + args.chunk_len]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, state = raw_model(x, state)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1), reduction="sum")
            loss_sum += loss
            tok_sum += y.numel()
    dist.all_reduce(loss_sum)
    dist.all_reduce(tok_sum)
    raw_model.train()
    return (loss_sum / tok_sum).item()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    is_main = rank == 0
    if is_main:
        os.makedirs(args.out_dir, exist_ok=True)

    train_ds = StreamDataset(args.data, args.stream_len)
    val_ds = StreamDataset(args.val_data, args.stream_len)
    val_ds = Subset(val_ds, list(range(rank, min(len(val_ds), args.eval_streams), world)))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, num_workers=2)

    model = RWKVLM(args.vocab_size, args.d_model, args.n_layer, args.head_size).to(device)
    model = DDP(model, device_ids=[local_rank])
    raw_model = model.module

    decay, no_decay = [], []
    for n, p in raw_model.named_parameters():
        (decay if p.dim() >= 2 and "emb" not in n else no_decay).append(p)
    opt = torch.optim.AdamW([
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ], lr=args.lr, betas=(0.9, 0.99), eps=1e-8, fused=True)

    if is_main:
        n_params = sum(p.numel() for p in raw_model.parameters())
        print(f"params: {n_params / 1e6:.1f}M, world size {world}, "
              f"{len(train_loader)} batches/epoch/rank")

    step, epoch = 0, 0
    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for batch in train_loader:
            batch = batch.to(device, non_blocking=True)
            state = model.init_state(batch.size(0), device)
            for s in range(0, args.stream_len, args.chunk_len):
                x = batch[:, s:s + args.chunk_len]
                y = batch[:, s + 1:s + 1 + args.chunk_len]
                for g in opt.param_groups:
                    g["lr"] = lr_at(step, args)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits, state = model(x, state)
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
                opt.step()
                state = detach_state(state)
                step += 1

                if step % 50 == 0:
                    l = loss.detach()
                    dist.all_reduce(l, op=dist.ReduceOp.AVG)
                    if is_main:
                        dt = time.time() - t0
                        tps = 50 * args.batch_size * args.chunk_len * world / dt
                        print(f"step {step} | loss {l.item():.4f} | gnorm {gnorm:.2f} | "
                              f"lr {lr_at(step, args):.2e} | {tps / 1e3:.1f}k tok/s")
                        t0 = time.time()

                if step % args.eval_every == 0:
                    val_loss = evaluate(raw_model, val_loader, args, device)
                    if is_main:
                        print(f"step {step} | val loss {val_loss:.4f} | ppl {math.exp(val_loss):.2f}")

                if step % args.save_every == 0 and is_main:
                    torch.save({"model": raw_model.state_dict(), "opt": opt.state_dict(),
                                "step": step, "args": vars(args)},
                               os.path.join(args.out_dir, f"ckpt_{step:07d}.pt"))

                if step >= args.max_steps:
                    break
            if step >= args.max_steps:
                break
        epoch += 1

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
