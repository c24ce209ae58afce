"""Small BERT-style masked-LM pretraining on pre-tokenized shards (uint16 .npy), with
LayerDrop and activation checkpointing to fit long sequences.

    torchrun --nproc_per_node=8 pretrain_mlm.py --data data/tokens --seq-len 1024 --grad-ckpt
"""
import argparse
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

VOCAB_SIZE, PAD_ID, MASK_ID, CLS_ID, SEP_ID = 32000, 0, 4, 2, 3


class TokenBlocks(Dataset):
    """Concatenated token stream cut into fixed-length blocks (memory-mapped)."""

    def __init__(self, pattern, seq_len):
        self.arrays = [np.load(f, mmap_mode="r") for f in sorted(glob.glob(pattern))]
        self.seq_len = seq_len - 2
        self.index = [(a, s) for a, arr in enumerate(self.arrays)
                      for s in range(0, len(arr) - self.seq_len, self.seq_len)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        a, s = self.index[i]
        body = torch.from_numpy(self.arrays[a][s:s + self.seq_len].astype(np.int64))
        return torch.cat([torch.tensor([CLS_ID]), body, torch.tensor([SEP_ID])])


def mask_tokens(ids, prob=0.15):
    labels = ids.clone()
    special = (ids == CLS_ID) | (ids == SEP_ID) | (ids == PAD_ID)
    chosen = (torch.rand(ids.shape, device=ids.device) < prob) & ~special
    labels[~chosen] = -100
    r = torch.rand(ids.shape, device=ids.device)
    ids = ids.clone()
    ids[chosen & (r < 0.8)] = MASK_ID
    rand_sel = chosen & (r >= 0.8) & (r < 0.9)
    ids[rand_sel] = torch.randint(5, VOCAB_SIZE, (int(rand_sel.sum()),), device=ids.device)
    return ids, labels


class EncoderLayer(nn.Module):
    def __init__(self, d, heads, ff):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=0.1, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d), nn.Dropout(0.1))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(self.ln2(x))


class MLMModel(nn.Module):
    def __init__(self, d=768, layers=12, heads=12, ff=3072, max_len=1024, layerdrop=0.1, grad_ckpt=False):
        super().__init__()
        self.tok = nn.Embedding(VOCAB_SIZE, d, padding_idx=PAD_ID)
        self.pos = nn.Embedding(max_len, d)
        self.layers = nn.ModuleList([EncoderLayer(d, heads, ff) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB_SIZE, bias=False)
        self.lm_head.weight = self.tok.weight
        self.layerdrop, self.grad_ckpt = layerdrop, grad_ckpt

    def forward(self, ids):
        pos = torch.arange(ids.size(1), device=ids.device)
        x = self.tok(ids) + self.pos(pos)[None]
        for layer in self.layers:
            if self.training and torch.rand(()) < self.layerdrop:
                continue  # LayerDrop: skip the whole layer this step
            if self.grad_ckpt and self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True)
            else:
                x = layer(x)
        return self.lm_head(self.ln_f(x))


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="ckpt/mlm")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--max-steps", type=int, default=100000)
    p.add_argument("--warmup", type=int, default=4000)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--layerdrop", type=float, default=0.1)
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--save-every", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    # per-rank RNG for LayerDrop / masking decisions
    torch.cuda.manual_seed(args.seed + rank)

    ds = TokenBlocks(os.path.join(args.data, "train_*.npy"), args.seq_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    model = MLMModel(max_len=args.seq_len, layerdrop=args.layerdrop, grad_ckpt=args.grad_ckpt).to(device)
    # LayerDrop leaves the skipped layers without gradients, so DDP must look for unused parameters
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * max(0.0, 1 - s / args.max_steps))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{n_params / 1e6:.1f}M params, {len(ds)} blocks, {world} GPUs, "
              f"{args.batch_size * world * args.seq_len} tokens/step")

    step, epoch, t0 = 0, 0, time.time()
    stat = torch.zeros(2, device=device)
    model.train()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for ids in loader:
            ids = ids.to(device, non_blocking=True)
            inp, labels = mask_tokens(ids)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(inp)
            loss = F.cross_entropy(logits.float().view(-1, VOCAB_SIZE), labels.view(-1), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            stat += torch.stack([loss.detach(), torch.ones((), device=device)])
            if step % 100 == 0:
                dist.all_reduce(stat)
                if rank == 0:
                    avg = (stat[0] / stat[1]).item()
                    print(f"step {step} loss {avg:.4f} ppl {math.exp(min(avg, 20)):.1f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 100:.2f}s/it", flush=True)
                stat.zero_()
                t0 = time.time()
            if step % args.save_every == 0 and rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                           os.path.join(args.out, f"step_{step}.pt"))
            if step >= args.max_steps:
                break
        epoch += 1
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
