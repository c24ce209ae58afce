"""Successive-halving sweep of learning rate and weight decay for a small GPT.

All configurations of a rung are trained one after another in the same process
group; the best 1/eta of them are promoted and continue training (their state
is kept in host memory between rungs).  Runs that blow up are cut early.

    torchrun --standalone --nproc_per_node=8 06_sha_lr_sweep_gpt.py --data data/openwebtext
"""
import argparse
import itertools
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class Block(nn.Module):
    def __init__(self, d, n_head, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, n_head, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=50304, block=256, d=384, layers=6, n_head=6, dropout=0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.blocks = nn.ModuleList([Block(d, n_head, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.register_buffer("mask", torch.triu(torch.full((block, block), float("-inf")), 1), persistent=False)

    def forward(self, idx, targets):
        T = idx.size(1)
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x, self.mask[:T, :T])
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def get_batch(data, block, bs, gen, device):
    ix = torch.randint(len(data) - block - 1, (bs,), generator=gen)
    x = torch.stack([torch.from_numpy(data[i:i + block].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


def lr_at(step, cfg, total):
    if step < cfg["warmup"]:
        return cfg["lr"] * (step + 1) / cfg["warmup"]
    ratio = (step - cfg["warmup"]) / max(1, total - cfg["warmup"])
    return cfg["lr"] * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, ratio))))


@torch.no_grad()
def estimate_val(model, val, args, device, rank):
    model.eval()
    gen = torch.Generator().manual_seed(1000 + rank)
    tot = torch.zeros(1, device=device)
    for _ in range(args.eval_iters):
        x, y = get_batch(val, args.block, args.micro_bs, gen, device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            tot += model(x, y)
    dist.all_reduce(tot)
    model.train()
    return tot.item() / (args.eval_iters * dist.get_world_size())


def train_config(cfg, state, steps_from, steps_to, total_steps, args, data, device, local_rank, rank):
    train, val = data
    model = GPT(block=args.block).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95),
                            weight_decay=cfg["wd"], fused=True)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    model = DDP(model, device_ids=[local_rank])
    gen = torch.Generator().manual_seed(cfg["id"] * 7919 + steps_from * 31 + rank)

    first_loss, diverged = None, False
    for step in range(steps_from, steps_to):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg, total_steps)
        x, y = get_batch(train, args.block, args.micro_bs, gen, device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        if first_loss is None:
            first_loss = loss.item()
        elif step - steps_from > 50 and loss.item() > args.diverge_factor * first_loss:
            diverged = True
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    val_loss = float("inf") if diverged else estimate_val(model, val, args, device, rank)
    new_state = {"model": {k: v.detach().cpu() for k, v in model.module.state_dict().items()},
                 "opt": opt.state_dict()}
    new_state["opt"]["state"] = {k: {n: t.cpu() if torch.is_tensor(t) else t for n, t in s.items()}
                                 for k, s in new_state["opt"]["state"].items()}
    del model, opt
    torch.cuda.empty_cache()
    return val_loss, (None if diverged else new_state)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/openwebtext")
    ap.add_argument("--out", default="sweeps/sha_gpt")
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--micro-bs", type=int, default=32)
    ap.add_argument("--min-steps", type=int, default=500)
    ap.add_argument("--eta", type=int, default=3)
    ap.add_argument("--rungs", type=int, default=4)
    ap.add_argument("--eval-iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--diverge-factor", type=float, default=1.5)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1337)
    torch.backends.cuda.matmul.allow_tf32 = True

    train = np.memmap(os.path.join(args.data, "train.bin"), dtype=np.uint16, mode="r")
    val = np.memmap(os.path.join(args.data, "val.bin"), dtype=np.uint16, mode="r")

    grid = itertools.product([3e-4, 6e-4, 1e-3, 2e-3, 4e-3, 8e-3], [0.0, 0.1])
    configs = [dict(id=i, lr=lr, warmup=args.warmup, wd=wd) for i, (lr, wd) in enumerate(grid)]
    total_steps = args.min_steps * args.eta ** (args.rungs - 1)
    states = {c["id"]: None for c in configs}
    done = {c["id"]: 0 for c in configs}

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        log = open(os.path.join(args.out, "sha.jsonl"), "a")

    alive = configs
    for rung in range(args.rungs):
        budget = args.min_steps * args.eta ** rung
        results = []
        for cfg in alive:
            t0 = time.time()
            loss, st = train_config(cfg, states[cfg["id"]], done[cfg["id"]], budget, total_steps,
                                    args, (train, val), device, local_rank, rank)
            states[cfg["id"]], done[cfg["id"]] = st, budget
            results.append((loss, cfg))
            if rank == 0:
                log.write(json.dumps(dict(rung=rung, steps=budget, val_loss=loss, secs=time.time() - t0, **cfg)) + "\n")
                log.flush()
        results.sort(key=lambda r: r[0])
        keep = max(1, len(results) // args.eta)
        alive = [c for l, c in results[:keep] if math.isfinite(l)]
        for l, c in results[keep:]:
            states[c["id"]] = None
        if rank == 0:
            print(f"rung {rung}: kept {[c['id'] for c in alive]} best {results[0][0]:.4f}", flush=True)
        if not alive:
            break

    if rank == 0:
        print("winner:", alive[0] if alive else None)
        log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
