"""
Deep-narrow GPT (48 layers, d=1024) pretraining with LayerDrop and activation checkpointing.

LayerDrop (Fan et al. 2019) skips whole blocks at random during training, so a pruned
shallower model can be extracted later; activation checkpointing keeps 2k-token contexts in memory.

    torchrun --nproc_per_node=8 19_deep_gpt_layerdrop_ckpt.py --data /data/pile_neox --out runs/deep48
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
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, C))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class DeepGPT(nn.Module):
    def __init__(self, vocab, ctx, d, n_head, n_layer, layerdrop=0.1, grad_ckpt=True):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList([Block(d, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.layerdrop = layerdrop
        self.grad_ckpt = grad_ckpt
        for n, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if n.endswith(("o.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx):
        x = self.emb(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for blk in self.blocks:
            if self.training and self.layerdrop > 0 and torch.rand(()) < self.layerdrop:
                continue
            if self.training and self.grad_ckpt:
                x = checkpoint(blk, x, use_reentrant=True)
            else:
                x = blk(x)
        return self.head(self.ln_f(x))


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--layerdrop", type=float, default=0.1)
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup", type=int, default=3000)
    p.add_argument("--steps", type=int, default=120000)
    p.add_argument("--eval_every", type=int, default=2000)
    p.add_argument("--eval_batches", type=int, default=25)
    return p.parse_args()


def main():
    a = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)

    train = np.memmap(os.path.join(a.data, "train.bin"), dtype=np.uint16, mode="r")
    val = np.memmap(os.path.join(a.data, "val.bin"), dtype=np.uint16, mode="r")
    gen = torch.Generator().manual_seed(2024 + rank)

    def batch(split):
        src = train if split == "train" else val
        ix = torch.randint(len(src) - a.ctx - 1, (a.bs,), generator=gen)
        t = torch.stack([torch.from_numpy(src[i:i + a.ctx + 1].astype(np.int64)) for i in ix.tolist()])
        t = t.to(dev, non_blocking=True)
        return t[:, :-1], t[:, 1:]

    torch.manual_seed(0)
    model = DeepGPT(50304, a.ctx, a.d, a.heads, a.layers, layerdrop=a.layerdrop).to(dev)
    torch.manual_seed(100 + rank)  # per-rank LayerDrop pattern
    # blocks skipped by LayerDrop get no gradient in that step
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def lr_at(s):
        if s < a.warmup:
            return a.lr * (s + 1) / a.warmup
        return a.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (s - a.warmup) / (a.steps - a.warmup)))))

    step = 0
    ck_path = os.path.join(a.out, "ckpt.pt")
    if os.path.exists(ck_path):
        ck = torch.load(ck_path, map_location=dev)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step = ck["step"]
        gen.manual_seed(2024 + rank + 7919 * step)
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)

    t0 = time.time()
    model.train()
    while step < a.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        tot = 0.0
        for m in range(a.accum):
            x, y = batch("train")
            model.require_backward_grad_sync = m == a.accum - 1
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1)) / a.accum
            loss.backward()
            tot += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        if step % 20 == 0 and rank == 0:
            dt, t0 = time.time() - t0, time.time()
            print(f"step {step} loss {tot:.4f} lr {lr_at(step):.2e} "
                  f"{20 * a.bs * a.accum * a.ctx * world / dt:,.0f} tok/s", flush=True)

        if step % a.eval_every == 0:
            model.eval()
            vl = torch.zeros((), device=dev)
            with torch.no_grad():
                for _ in range(a.eval_batches):
                    x, y = batch("val")
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        lg = model.module(x)
                    vl += F.cross_entropy(lg.float().view(-1, lg.size(-1)), y.reshape(-1)) / a.eval_batches
            dist.all_reduce(vl, op=dist.ReduceOp.AVG)
            model.train()
            if rank == 0:
                print(f"step {step} val loss {vl.item():.4f} ppl {math.exp(vl.item()):.2f}", flush=True)
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                           ck_path + ".tmp")
                os.replace(ck_path + ".tmp", ck_path)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
