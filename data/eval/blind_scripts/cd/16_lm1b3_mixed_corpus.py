"""
1.3B pretraining run on the mixed web/code corpus. bf16 autocast, compile, cosine
schedule in iterations. Has a guard against loss spikes: a micro-batch whose loss is
NaN/Inf is dropped together with the rest of that step's accumulation.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=node001:29500 \
        16_lm1b3_mixed_corpus.py --data /shared/mix_v3 --out /shared/ckpt/lm1b3
"""
import os
import math
import time
import argparse
import logging
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

log = logging.getLogger("train")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--gbs", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--iters", type=int, default=120000)
    p.add_argument("--eval_every", type=int, default=1000)
    p.add_argument("--eval_iters", type=int, default=25)
    p.add_argument("--save_every", type=int, default=1000)
    return p.parse_args()


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.n1 = nn.LayerNorm(d)
        self.n2 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.w_in = nn.Linear(d, 4 * d, bias=False)
        self.w_out = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.w_out(F.gelu(self.w_in(self.n2(x)), approximate="tanh"))


class LM(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.emb = nn.Embedding(a.vocab, a.dim)
        self.pos = nn.Embedding(a.seq, a.dim)
        self.blocks = nn.ModuleList(Block(a.dim, a.heads) for _ in range(a.layers))
        self.norm = nn.LayerNorm(a.dim)
        self.head = nn.Linear(a.dim, a.vocab, bias=False)
        for n, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * a.layers) if n.endswith(("proj.weight", "w_out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx, tgt):
        x = self.emb(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), tgt.view(-1))


def main():
    a = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    lr_ = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr_)
    dev = torch.device("cuda", lr_)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{rank}] %(levelname)s %(message)s")
    if rank != 0:
        log.setLevel(logging.WARNING)

    assert a.gbs % (a.mbs * world) == 0
    accum = a.gbs // (a.mbs * world)
    tokens_per_iter = a.gbs * a.seq

    train = np.memmap(os.path.join(a.data, "train.bin"), dtype=np.uint16, mode="r")
    val = np.memmap(os.path.join(a.data, "val.bin"), dtype=np.uint16, mode="r")

    def batch(data, g):
        ix = torch.randint(len(data) - a.seq - 1, (a.mbs,), generator=g).tolist()
        xy = torch.from_numpy(np.stack([data[i:i + a.seq + 1] for i in ix]).astype(np.int64))
        xy = xy.pin_memory().to(dev, non_blocking=True)
        return xy[:, :-1], xy[:, 1:]

    torch.manual_seed(0)
    model = LM(a).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8, fused=True)

    it = 0
    ckpt = os.path.join(a.out, "last.pt")
    if os.path.exists(ckpt):
        sd = torch.load(ckpt, map_location="cpu")
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
        it = sd["it"]
        log.info("resumed at iter %d", it)
    g_train = torch.Generator().manual_seed(10_000 * rank + it)
    model = DDP(torch.compile(model), device_ids=[lr_])

    def lr_at(i):
        if i < a.warmup:
            return a.lr * (i + 1) / a.warmup
        r = min(1.0, (i - a.warmup) / (a.iters - a.warmup))
        return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * r)))

    @torch.no_grad()
    def evaluate():
        model.eval()
        g = torch.Generator().manual_seed(555 + rank)
        s = torch.zeros((), device=dev)
        for _ in range(a.eval_iters):
            x, y = batch(val, g)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                s += model(x, y)
        dist.all_reduce(s, op=dist.ReduceOp.AVG)
        model.train()
        return s.item() / a.eval_iters

    skipped = 0
    t0 = time.time()
    while it < a.iters:
        lr = lr_at(it)
        for grp in opt.param_groups:
            grp["lr"] = lr

        bad_step = False
        loss_acc = 0.0
        for m in range(accum):
            x, y = batch(train, g_train)
            with (model.no_sync() if m < accum - 1 else nullcontext()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(x, y)
                if not torch.isfinite(loss):
                    bad_step = True
                    break
                (loss / accum).backward()
            loss_acc += loss.item() / accum
        if bad_step:
            skipped += 1
            log.warning("non-finite loss at iter %d, skipping step (%d skipped so far)", it, skipped)
            opt.zero_grad(set_to_none=True)
            continue

        gnorm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        it += 1

        if it % 10 == 0:
            torch.cuda.synchronize()
            dt = (time.time() - t0) / 10
            t0 = time.time()
            tps = tokens_per_iter / dt
            log.info("iter %d loss %.4f lr %.2e gnorm %.2f | %.0f tok/s | mfu %.1f%% | skipped %d",
                     it, loss_acc, lr, gnorm.item(), tps, 100 * 6 * n_params * tps / (world * 989e12), skipped)

        if it % a.eval_every == 0:
            log.info("iter %d val_loss %.4f", it, evaluate())

        if it % a.save_every == 0:
            if rank == 0:
                os.makedirs(a.out, exist_ok=True)
                torch.save({"model": model.module._orig_mod.state_dict(), "opt": opt.state_dict(), "it": it,
                            "args": vars(a)}, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
