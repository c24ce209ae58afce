"""ALBERT-style (cross-layer parameter sharing) masked-LM pretraining.
DDP, bf16 autocast, activation checkpointing per layer application, grad accumulation.

torchrun --nproc_per_node=8 07_ddp_albert_actckpt.py --shards /data/wiki_bookcorpus_tok --steps 125000
"""
import argparse
import contextlib
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

PAD, CLS, SEP, MASK = 0, 101, 102, 103


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--shards", required=True, help="dir with *.npy arrays of shape [N, seq_len]")
    p.add_argument("--vocab", type=int, default=30000)
    p.add_argument("--emb", type=int, default=128)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--depth", type=int, default=24)
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--micro_bsz", type=int, default=32)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=1.76e-3)
    p.add_argument("--warmup", type=int, default=3125)
    p.add_argument("--steps", type=int, default=125000)
    p.add_argument("--ckpt_dir", default="albert_large_ckpt")
    p.add_argument("--grad_ckpt", action="store_true")
    return p.parse_args()


class TokenShards(Dataset):
    def __init__(self, folder):
        self.arrays = [np.load(f, mmap_mode="r") for f in sorted(glob.glob(os.path.join(folder, "*.npy")))]
        self.offsets = np.cumsum([0] + [len(a) for a in self.arrays])

    def __len__(self):
        return int(self.offsets[-1])

    def __getitem__(self, i):
        s = int(np.searchsorted(self.offsets, i, side="right") - 1)
        return torch.from_numpy(np.array(self.arrays[s][i - self.offsets[s]], dtype=np.int64))


def mask_tokens(ids, vocab, p=0.15):
    labels = ids.clone()
    special = (ids == PAD) | (ids == CLS) | (ids == SEP)
    prob = torch.full(ids.shape, p, device=ids.device).masked_fill(special, 0.0)
    masked = torch.bernoulli(prob).bool()
    labels[~masked] = -100
    replace = torch.bernoulli(torch.full(ids.shape, 0.8, device=ids.device)).bool() & masked
    ids = ids.masked_fill(replace, MASK)
    rand = torch.bernoulli(torch.full(ids.shape, 0.5, device=ids.device)).bool() & masked & ~replace
    ids[rand] = torch.randint(vocab, ids.shape, device=ids.device)[rand]
    return ids, labels


class SharedEncoderLayer(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, h, batch_first=True)
        self.ln1 = nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.ln2 = nn.LayerNorm(d)

    def forward(self, x, pad_mask):
        a, _ = self.attn(x, x, x, key_padding_mask=pad_mask, need_weights=False)
        x = self.ln1(x + a)
        return self.ln2(x + self.ffn(x))


class AlbertMLM(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok = nn.Embedding(a.vocab, a.emb, padding_idx=PAD)
        self.pos = nn.Embedding(a.seq_len, a.emb)
        self.emb_ln = nn.LayerNorm(a.emb)
        self.proj_in = nn.Linear(a.emb, a.hidden)
        self.layer = SharedEncoderLayer(a.hidden, a.heads)
        self.depth = a.depth
        self.grad_ckpt = a.grad_ckpt
        self.head = nn.Sequential(nn.Linear(a.hidden, a.emb), nn.GELU(), nn.LayerNorm(a.emb))
        self.bias = nn.Parameter(torch.zeros(a.vocab))

    def forward(self, ids):
        pad_mask = ids == PAD
        pos = torch.arange(ids.size(1), device=ids.device)
        x = self.proj_in(self.emb_ln(self.tok(ids) + self.pos(pos)))
        for _ in range(self.depth):
            if self.grad_ckpt and self.training:
                x = checkpoint(self.layer, x, pad_mask, use_reentrant=True)
            else:
                x = self.layer(x, pad_mask)
        h = self.head(x)
        return h @ self.tok.weight.t() + self.bias


def lr_lambda(step, warmup, total):
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def main():
    a = cli()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    ds = TokenShards(a.shards)
    sampler = DistributedSampler(ds, shuffle=True, seed=42, drop_last=True)
    loader = DataLoader(ds, batch_size=a.micro_bsz, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    model = AlbertMLM(a).to(dev)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, a.warmup, a.steps))

    step, epoch = 0, 0
    start = 0
    latest = os.path.join(a.ckpt_dir, "latest.pt")
    if os.path.isfile(latest):
        st = torch.load(latest, map_location=dev)
        model.module.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        step, epoch = st["step"], st["epoch"]
        if rank == 0:
            print(f"resuming at step {step}", flush=True)

    model.train()
    tic = time.time()
    while step < a.steps:
        sampler.set_epoch(epoch)
        for i, ids in enumerate(loader):
            ids = ids[:, : a.seq_len].to(dev, non_blocking=True)
            inp, labels = mask_tokens(ids, a.vocab)
            final_micro = (i + 1) % a.accum == 0
            with contextlib.nullcontext() if final_micro else model.no_sync():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(inp)
                loss = F.cross_entropy(logits.float().view(-1, a.vocab), labels.view(-1), ignore_index=-100)
                (loss / a.accum).backward()
            if not final_micro:
                continue
            gn = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l)
                if rank == 0:
                    print(f"step {step} mlm_loss {l.item() / world:.4f} gnorm {gn.item():.2f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - tic) / 50:.2f}s/step", flush=True)
                tic = time.time()
            if step % 5000 == 0 and rank == 0:
                os.makedirs(a.ckpt_dir, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "step": step, "epoch": epoch},
                           latest + ".tmp")
                os.replace(latest + ".tmp", latest)
            if step >= a.steps:
                break
        epoch += 1

    dist.barrier()
    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(a.ckpt_dir, "final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
