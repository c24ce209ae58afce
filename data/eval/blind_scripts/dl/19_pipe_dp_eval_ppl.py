"""GPipe pipeline (pp stages) x data parallel (dp replicas) for a causal LM.

Global rank r -> stage r % pp, replica r // pp. Every replica runs its own
pipeline; gradients of matching stages are averaged across replicas.

    torchrun --nproc_per_node=8 19_pipe_dp_eval_ppl.py --pp 4 --train data/c4_train.bin --val data/c4_val.bin
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
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32128)
    ap.add_argument("--d", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-batches", type=int, default=64)
    ap.add_argument("--out", default="ckpt/pp_dp")
    return ap.parse_args()


class Layout:
    def __init__(self, pp):
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.pp, self.dp = pp, world // pp
        self.stage, self.replica = self.rank % pp, self.rank // pp
        self.is_first, self.is_last = self.stage == 0, self.stage == pp - 1
        self.pipe_group = self.dp_group = None
        for rep in range(self.dp):
            g = dist.new_group([rep * pp + s for s in range(pp)])
            if rep == self.replica:
                self.pipe_group = g
        for s in range(pp):
            g = dist.new_group([rep * pp + s for rep in range(self.dp)])
            if s == self.stage:
                self.dp_group = g
        self.last_rank_of_pipe = self.replica * pp + pp - 1


class DecoderBlock(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.h, -1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.ff(self.norm2(x))


def build_stage(args, lay):
    per = args.layers // lay.pp
    parts = nn.ModuleDict()
    if lay.is_first:
        parts["tok"] = nn.Embedding(args.vocab, args.d)
        parts["pos"] = nn.Embedding(args.seq, args.d)
    parts["blocks"] = nn.ModuleList(DecoderBlock(args.d, args.heads) for _ in range(per))
    if lay.is_last:
        parts["norm"] = nn.LayerNorm(args.d)
        parts["lm_head"] = nn.Linear(args.d, args.vocab, bias=False)
    return parts


def stage_forward(parts, lay, x):
    if lay.is_first:
        x = parts["tok"](x) + parts["pos"](torch.arange(x.size(1), device=x.device))
    for b in parts["blocks"]:
        x = b(x)
    if lay.is_last:
        x = parts["lm_head"](parts["norm"](x))
    return x


def run_pipeline(parts, lay, args, x, y, train):
    """GPipe: all forwards, then all backwards. Returns the mean loss on the last stage."""
    shape = (args.mbs, args.seq, args.d)
    xs, ys = x.chunk(args.chunks), y.chunk(args.chunks)
    keep, total = [], 0.0
    for i in range(args.chunks):
        if lay.is_first:
            inp = xs[i].cuda(non_blocking=True)
        else:
            inp = torch.empty(shape, device="cuda")
            dist.recv(inp, src=lay.rank - 1)
            inp.requires_grad_(train)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = stage_forward(parts, lay, inp)
        if lay.is_last:
            loss = F.cross_entropy(out.float().flatten(0, 1), ys[i].cuda(non_blocking=True).flatten())
            total += loss.item() / args.chunks
            keep.append((inp, loss / args.chunks))
        else:
            out = out.float()
            dist.send(out.detach(), dst=lay.rank + 1)
            keep.append((inp, out))
    if train:
        for inp, out in keep:
            if lay.is_last:
                out.backward()
            else:
                g = torch.empty(shape, device="cuda")
                dist.recv(g, src=lay.rank + 1)
                out.backward(g)
            if not lay.is_first:
                dist.send(inp.grad, dst=lay.rank - 1)
    return total


def allreduce_dp(parts, lay):
    grads = [p.grad for p in parts.parameters() if p.grad is not None]
    buf = _flatten_dense_tensors(grads)
    dist.all_reduce(buf, op=dist.ReduceOp.AVG, group=lay.dp_group)
    for g, r in zip(grads, _unflatten_dense_tensors(buf, grads)):
        g.copy_(r)


class TokenFile(Dataset):
    def __init__(self, path, seq):
        self.t, self.seq = np.memmap(path, dtype=np.uint16, mode="r"), seq

    def __len__(self):
        return (len(self.t) - 1) // self.seq

    def __getitem__(self, i):
        c = torch.from_numpy(self.t[i * self.seq:(i + 1) * self.seq + 1].astype(np.int64))
        return c[:-1], c[1:]


def main():
    args = get_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    lay = Layout(args.pp)
    torch.manual_seed(100 + lay.stage)  # same stage -> same init on every replica

    parts = build_stage(args, lay).cuda()
    opt = torch.optim.AdamW(parts.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    bs = args.mbs * args.chunks
    train_ds, val_ds = TokenFile(args.train, args.seq), TokenFile(args.val, args.seq)
    sampler = DistributedSampler(train_ds, num_replicas=lay.dp, rank=lay.replica, shuffle=True, seed=0)
    train_dl = DataLoader(train_ds, batch_size=bs, sampler=sampler, num_workers=2, pin_memory=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=lay.dp, rank=lay.replica, shuffle=False)
    val_dl = DataLoader(val_ds, batch_size=bs, sampler=val_sampler, drop_last=True)
    total_steps = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total_steps, pct_start=0.02)

    step, best = 0, float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        parts.train()
        t0 = time.time()
        for x, y in train_dl:
            opt.zero_grad(set_to_none=True)
            loss = run_pipeline(parts, lay, args, x, y, train=True)
            allreduce_dp(parts, lay)
            opt.step()
            sched.step()
            step += 1
            if lay.is_last and step % 20 == 0:
                t = torch.tensor([loss], device="cuda")
                dist.all_reduce(t, op=dist.ReduceOp.AVG, group=lay.dp_group)
                if lay.replica == 0:
                    print(f"step {step}/{total_steps} loss {t.item():.4f} {(time.time() - t0) / 20:.2f}s/step", flush=True)
                t0 = time.time()

            if step % args.eval_every == 0:
                parts.eval()
                vl = 0.0
                with torch.no_grad():
                    for i, (vx, vy) in enumerate(val_dl):
                        if i == args.eval_batches:
                            break
                        vl += run_pipeline(parts, lay, args, vx, vy, train=False)
                vl /= min(args.eval_batches, len(val_dl))
                # the last stage has the number; the rest of this pipeline needs it for the "best" decision
                v = torch.tensor([vl], device="cuda")
                dist.broadcast(v, src=lay.last_rank_of_pipe, group=lay.pipe_group)
                vl = v.item()
                if lay.is_last and lay.replica == 0:
                    print(f"step {step} val_loss {vl:.4f} val_ppl {math.exp(vl):.2f}", flush=True)
                if vl < best:
                    best = vl
                    if lay.replica == 0:
                        os.makedirs(args.out, exist_ok=True)
                        torch.save({"stage": parts.state_dict(), "step": step, "val_loss": vl},
                                   os.path.join(args.out, f"best_stage{lay.stage}.pt"))
                parts.train()

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
