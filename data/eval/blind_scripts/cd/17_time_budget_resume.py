"""
Preemptible pretraining job for the shared cluster: stops cleanly when a worker gets
SIGTERM/SIGUSR1 or when the wall-clock budget runs out, writes a checkpoint, and the
next allocation resumes from it.

    # on each of the 2 nodes
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=gpu-node01:29500 \
        17_time_budget_resume.py --out /shared/ckpt/qknorm-350m --qk_norm --time_budget_min 235
"""
import os
import math
import time
import signal
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

STOP_REQUESTED = False


def _handle_signal(signum, frame):
    global STOP_REQUESTED
    STOP_REQUESTED = True


class Attention(nn.Module):
    def __init__(self, d, h, qk_norm):
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        if qk_norm:
            self.q_norm = nn.RMSNorm(d // h)
            self.k_norm = nn.RMSNorm(d // h)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d, h, qk_norm):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.attn = Attention(d, h, qk_norm)
        self.fc1 = nn.Linear(d, 4 * d, bias=False)
        self.fc2 = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.fc2(F.relu(self.fc1(self.n2(x))).square())


class GPT(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.wte = nn.Embedding(a.vocab, a.d)
        self.wpe = nn.Embedding(a.seq, a.d)
        self.blocks = nn.ModuleList(Block(a.d, a.heads, a.qk_norm) for _ in range(a.layers))
        self.norm = nn.RMSNorm(a.d)
        self.head = nn.Linear(a.d, a.vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, tgt):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), tgt.view(-1))


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/shared/data/fineweb10B")
    p.add_argument("--out", default="/shared/ckpt/run")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--qk_norm", action="store_true")
    p.add_argument("--mbs", type=int, default=16)
    p.add_argument("--global_tokens", type=int, default=524288)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--iters", type=int, default=40000)
    p.add_argument("--eval_every", type=int, default=500)
    p.add_argument("--eval_iters", type=int, default=20)
    p.add_argument("--save_every", type=int, default=1000)
    p.add_argument("--time_budget_min", type=float, default=0.0)
    return p.parse_args()


def main():
    a = parse()
    signal.signal(signal.SIGTERM, _handle_signal)
    signal.signal(signal.SIGUSR1, _handle_signal)
    start = time.time()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    master = rank == 0

    per_micro = a.mbs * a.seq * world
    assert a.global_tokens % per_micro == 0, f"global_tokens must be a multiple of {per_micro}"
    accum = a.global_tokens // per_micro

    torch.manual_seed(1234)
    model = GPT(a).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    it = 0
    path = os.path.join(a.out, "ckpt.pt")
    if os.path.exists(path):
        sd = torch.load(path, map_location=dev)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
        it = sd["it"]
        del sd
        if master:
            print(f"resuming from iter {it}")

    model = DDP(torch.compile(model), device_ids=[local_rank], find_unused_parameters=False)

    train = np.memmap(os.path.join(a.data, "train.bin"), dtype=np.uint16, mode="r")
    val = np.memmap(os.path.join(a.data, "val.bin"), dtype=np.uint16, mode="r")
    g = torch.Generator().manual_seed(97 * rank + 1_000_003 * it)

    def batch(data, gen):
        ix = torch.randint(len(data) - a.seq - 1, (a.mbs,), generator=gen).tolist()
        xy = torch.from_numpy(np.stack([data[i:i + a.seq + 1] for i in ix]).astype(np.int64))
        xy = xy.pin_memory().to(dev, non_blocking=True)
        return xy[:, :-1], xy[:, 1:]

    def lr_at(i):
        if i < a.warmup:
            return a.lr * (i + 1) / a.warmup
        r = min(1.0, (i - a.warmup) / (a.iters - a.warmup))
        return a.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * r)))

    @torch.no_grad()
    def evaluate():
        model.eval()
        vg = torch.Generator().manual_seed(4242 + rank)
        s = torch.zeros((), device=dev)
        for _ in range(a.eval_iters):
            x, y = batch(val, vg)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                s += model(x, y)
        dist.all_reduce(s, op=dist.ReduceOp.AVG)
        model.train()
        return s.item() / a.eval_iters

    def save():
        if master:
            os.makedirs(a.out, exist_ok=True)
            torch.save({"model": model.module._orig_mod.state_dict(), "opt": opt.state_dict(), "it": it,
                        "args": vars(a)}, path + ".tmp")
            os.replace(path + ".tmp", path)
        dist.barrier()

    stop = torch.zeros(1, device=dev)
    t0 = time.time()
    while it < a.iters:
        for grp in opt.param_groups:
            grp["lr"] = lr_at(it)
        for m in range(accum):
            x, y = batch(train, g)
            model.require_backward_grad_sync = m == accum - 1
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y) / accum
            loss.backward()
        gn = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        it += 1

        if it % 10 == 0:
            # every rank agrees on whether to stop: signal seen anywhere, or rank 0's clock says so
            over_budget = a.time_budget_min > 0 and (time.time() - start) / 60 > a.time_budget_min
            stop.fill_(1.0 if STOP_REQUESTED or (master and over_budget) else 0.0)
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            torch.cuda.synchronize()
            dt = (time.time() - t0) / 10
            t0 = time.time()
            if master:
                tps = a.global_tokens / dt
                print(f"it {it} loss {loss.item() * accum:.4f} gnorm {gn.item():.2f} "
                      f"{tps:,.0f} tok/s mfu {600 * n_params * tps / (world * 989e12):.1f}%", flush=True)
            if stop.item() > 0:
                if master:
                    print(f"stopping at iter {it}, saving checkpoint", flush=True)
                save()
                break

        if it % a.eval_every == 0:
            vl = evaluate()
            if master:
                print(f"it {it} val_loss {vl:.4f}", flush=True)
        if it % a.save_every == 0:
            save()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
