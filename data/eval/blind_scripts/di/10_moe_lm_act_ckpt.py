#!/usr/bin/env python
"""
Top-2 MoE causal LM on a HF text dataset with activation checkpointing, gradient
accumulation and overflow-step skipping. Experts are replicated, routing may
leave an expert without tokens in a micro-batch, so DDP has to look for unused
parameters.

    torchrun --nproc_per_node=8 10_moe_lm_act_ckpt.py --dataset wikitext --subset wikitext-103-raw-v1 \
        --tokenizer gpt2 --cache /shared/cache/wt103_gpt2
"""
import argparse
import contextlib
import datetime
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp
import wandb
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="wikitext")
    ap.add_argument("--subset", default="wikitext-103-raw-v1")
    ap.add_argument("--tokenizer", default="gpt2")
    ap.add_argument("--cache", required=True, help="prefix for the tokenized .npy files (shared storage)")
    ap.add_argument("--out", default="ckpt/moe_actckpt")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--cf", type=float, default=1.25)
    ap.add_argument("--micro-bs", type=int, default=4)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--aux", type=float, default=0.01)
    ap.add_argument("--zloss", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--wandb-project", default=None)
    return ap.parse_args()


def tokenize_split(name, subset, split, tokenizer):
    ds = load_dataset(name, subset, split=split)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    ids = ds.map(lambda b: {"ids": [tok(t)["input_ids"] + [tok.eos_token_id] for t in b["text"]]},
                 batched=True, remove_columns=ds.column_names, num_proc=16)
    return np.fromiter((i for row in ids["ids"] for i in row), dtype=np.uint16)


def build_cache(args, rank):
    paths = {s: f"{args.cache}.{s}.npy" for s in ("train", "validation")}
    if rank == 0:
        AutoTokenizer.from_pretrained(args.tokenizer)  # download once before the other ranks ask for it
        for split, path in paths.items():
            if not os.path.exists(path):
                arr = tokenize_split(args.dataset, args.subset, split, args.tokenizer)
                tmp = path + ".tmp.npy"
                np.save(tmp, arr)
                os.replace(tmp, path)
    dist.barrier()
    return {s: np.load(p, mmap_mode="r") for s, p in paths.items()}


class Chunks(Dataset):
    def __init__(self, arr, seq):
        self.arr, self.seq = arr, seq

    def __len__(self):
        return (len(self.arr) - 1) // self.seq

    def __getitem__(self, i):
        x = torch.from_numpy(self.arr[i * self.seq:(i + 1) * self.seq + 1].astype(np.int64))
        return x[:-1], x[1:]


class MoE(nn.Module):
    def __init__(self, dim, n, cf):
        super().__init__()
        self.n, self.cf = n, cf
        self.router = nn.Linear(dim, n, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.GELU(), nn.Linear(4 * dim, dim, bias=False))
            for _ in range(n))

    def forward(self, x):
        B, T, D = x.shape
        x = x.reshape(-1, D)
        logits = self.router(x).float()
        probs = logits.softmax(-1)
        w, idx = probs.topk(2, -1)
        w = w / w.sum(-1, keepdim=True)
        cap = math.ceil(self.cf * 2 * x.size(0) / self.n)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, k = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            tok, k = tok[:cap], k[:cap]
            out.index_add_(0, tok, (expert(x[tok]) * w[tok, k, None]).to(out.dtype))
        frac = F.one_hot(idx[:, 0], self.n).float().mean(0)
        aux = self.n * (frac * probs.mean(0)).sum()
        z = logits.logsumexp(-1).pow(2).mean()
        return out.view(B, T, D), aux, z


class Block(nn.Module):
    def __init__(self, a, moe):
        super().__init__()
        self.h = a.heads
        self.n1, self.n2 = nn.LayerNorm(a.dim), nn.LayerNorm(a.dim)
        self.qkv = nn.Linear(a.dim, 3 * a.dim, bias=False)
        self.proj = nn.Linear(a.dim, a.dim, bias=False)
        self.moe = moe
        self.ff = MoE(a.dim, a.experts, a.cf) if moe else nn.Sequential(
            nn.Linear(a.dim, 4 * a.dim, bias=False), nn.GELU(), nn.Linear(4 * a.dim, a.dim, bias=False))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))
        if self.moe:
            y, aux, z = self.ff(self.n2(x))
        else:
            y = self.ff(self.n2(x))
            aux = z = torch.zeros((), device=x.device)
        return x + y, aux, z


class MoELM(nn.Module):
    def __init__(self, vocab, a):
        super().__init__()
        self.wte = nn.Embedding(vocab, a.dim)
        self.wpe = nn.Embedding(a.seq, a.dim)
        self.blocks = nn.ModuleList(Block(a, i % 2 == 1) for i in range(a.depth))
        self.norm = nn.LayerNorm(a.dim)
        self.lm_head = nn.Linear(a.dim, vocab, bias=False)
        self.grad_ckpt = True

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        aux_sum = z_sum = 0.0
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                x, aux, z = cp.checkpoint(blk, x, use_reentrant=False)
            else:
                x, aux, z = blk(x)
            aux_sum, z_sum = aux_sum + aux, z_sum + z
        return self.lm_head(self.norm(x)), aux_sum, z_sum


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # rank 0 may spend a while tokenizing before the first barrier
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    arrays = build_cache(args, rank)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    train_ds, val_ds = Chunks(arrays["train"], args.seq), Chunks(arrays["validation"], args.seq)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=1, drop_last=True)
    loader = DataLoader(train_ds, args.micro_bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, args.micro_bs, sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True),
                            num_workers=2, pin_memory=True)

    torch.manual_seed(1)
    model = MoELM(len(tok), args).to(device)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def lr_lambda(s):
        if s < args.warmup:
            return (s + 1) / args.warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - args.warmup) / (args.steps - args.warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    ckpt_file = os.path.join(args.out, "last.pt")
    step = 0
    if os.path.exists(ckpt_file):
        st = torch.load(ckpt_file, map_location="cpu")
        model.module.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        step = st["step"]

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        if args.wandb_project:
            wandb.init(project=args.wandb_project, config=vars(args), resume="allow")

    it = iter(loader)
    epoch = 0
    sampler.set_epoch(epoch)
    skipped = 0
    t0 = time.time()
    while step < args.steps:
        for micro in range(args.accum):
            try:
                x, y = next(it)
            except StopIteration:
                epoch += 1
                sampler.set_epoch(epoch)
                it = iter(loader)
                x, y = next(it)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync = micro == args.accum - 1
            with (contextlib.nullcontext() if sync else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits, aux, z = model(x)
                    ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                    loss = ce + args.aux * aux + args.zloss * z
                (loss / args.accum).backward()

        # grads are already averaged, so every rank sees the same norm and takes the same branch
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if torch.isfinite(gnorm):
            opt.step()
            sched.step()
            step += 1
        else:
            skipped += 1
        opt.zero_grad(set_to_none=True)

        if step % 20 == 0:
            stats = torch.stack([ce.detach(), aux.detach(), gnorm.detach()])
            dist.all_reduce(stats, op=dist.ReduceOp.AVG)
            if rank == 0:
                msg = {"ce": stats[0].item(), "aux": stats[1].item(), "gnorm": stats[2].item(),
                       "lr": sched.get_last_lr()[0], "skipped": skipped}
                print(f"step {step} " + " ".join(f"{k}={v:.4g}" for k, v in msg.items())
                      + f" {time.time() - t0:.1f}s", flush=True)
                if args.wandb_project:
                    wandb.log(msg, step=step)
            t0 = time.time()

        if step % args.eval_every == 0 and step > 0:
            model.eval()
            acc = torch.zeros(2, device=device)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                for i, (vx, vy) in enumerate(val_loader):
                    if i == 30:
                        break
                    vl, _, _ = model.module(vx.to(device))
                    acc[0] += F.cross_entropy(vl.float().flatten(0, 1), vy.to(device).flatten(), reduction="sum")
                    acc[1] += vy.numel()
            dist.all_reduce(acc)
            model.train()
            if rank == 0:
                val = (acc[0] / acc[1]).item()
                print(f"step {step} val_loss {val:.4f} ppl {math.exp(val):.1f}", flush=True)
                if args.wandb_project:
                    wandb.log({"val/loss": val}, step=step)
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "step": step}, ckpt_file)
            dist.barrier()

    if rank == 0 and args.wandb_project:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
