"""Llama-style pretraining with hand-written tensor parallelism (column / row
parallel linears, vocab-parallel embedding and cross-entropy) plus DDP across
tensor-parallel groups.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        18_tp_llama_pretrain.py --tp 8 --data /mnt/shared/packed_4k.npy --save /mnt/shared/ckpt/llama7b
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

PS = {}


def init_parallel_state(tp):
    world, rank = dist.get_world_size(), dist.get_rank()
    PS.update(tp=tp, dp=world // tp, tp_rank=rank % tp, dp_rank=rank // tp)
    for i in range(world // tp):
        g = dist.new_group(list(range(i * tp, (i + 1) * tp)))
        if i == PS["dp_rank"]:
            PS["tp_group"] = g
    for j in range(tp):
        g = dist.new_group(list(range(j, world, tp)))
        if j == PS["tp_rank"]:
            PS["dp_group"] = g


class CopyToModelParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=PS["tp_group"])
        return g


class ReduceFromModelParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        dist.all_reduce(x, group=PS["tp_group"])
        return x

    @staticmethod
    def backward(ctx, g):
        return g


def sharded(out_f, in_f, dim, std=0.02):
    w = torch.empty(out_f, in_f).normal_(0, std)
    return nn.Parameter(w.chunk(PS["tp"], dim)[PS["tp_rank"]].clone())


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotary(x, base=10000.0):
    T, D = x.shape[-2:]
    inv = base ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    f = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), inv)
    c, s = f.cos().to(x.dtype), f.sin().to(x.dtype)
    a, b = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([a * c - b * s, a * s + b * c], dim=-1)


class LlamaLayer(nn.Module):
    def __init__(self, d, nh, ffn, n_layers):
        super().__init__()
        tp = PS["tp"]
        self.nh, self.hd = nh // tp, d // nh
        self.attn_norm, self.ffn_norm = RMSNorm(d), RMSNorm(d)
        self.wqkv = sharded(3 * d, d, 0)
        self.wo = sharded(d, d, 1, 0.02 / math.sqrt(2 * n_layers))
        self.w13 = sharded(2 * ffn, d, 0)
        self.w2 = sharded(d, ffn, 1, 0.02 / math.sqrt(2 * n_layers))

    def forward(self, x):
        B, T, _ = x.shape
        h = CopyToModelParallel.apply(self.attn_norm(x))
        q, k, v = F.linear(h, self.wqkv).view(B, T, self.nh, 3, self.hd).permute(3, 0, 2, 1, 4)
        o = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        x = x + ReduceFromModelParallel.apply(F.linear(o.transpose(1, 2).reshape(B, T, -1), self.wo))
        h = CopyToModelParallel.apply(self.ffn_norm(x))
        gate, up = F.linear(h, self.w13).view(B, T, 2, -1).unbind(2)
        return x + ReduceFromModelParallel.apply(F.linear(F.silu(gate) * up, self.w2))


class Llama(nn.Module):
    def __init__(self, vocab, d, nh, nl, ffn):
        super().__init__()
        self.vp = vocab // PS["tp"]
        self.v0 = PS["tp_rank"] * self.vp
        self.embed = sharded(vocab, d, 0)
        self.layers = nn.ModuleList(LlamaLayer(d, nh, ffn, nl) for _ in range(nl))
        self.norm = RMSNorm(d)
        self.lm_head = sharded(vocab, d, 0)

    def forward(self, ids, labels):
        rel = ids - self.v0
        oob = (rel < 0) | (rel >= self.vp)
        x = F.embedding(rel.masked_fill(oob, 0), self.embed).masked_fill(oob[..., None], 0.0)
        x = ReduceFromModelParallel.apply(x)
        for layer in self.layers:
            x = layer(x)
        logits = F.linear(CopyToModelParallel.apply(self.norm(x)), self.lm_head).float()
        with torch.no_grad():
            mx = logits.amax(-1, keepdim=True)
            dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=PS["tp_group"])
        z = logits - mx
        lse = ReduceFromModelParallel.apply(z.exp().sum(-1)).log()
        hit = (labels >= self.v0) & (labels < self.v0 + self.vp)
        zt = z.gather(-1, (labels - self.v0).clamp(0, self.vp - 1)[..., None]).squeeze(-1) * hit
        return (lse - ReduceFromModelParallel.apply(zt)).mean()


class Packed(Dataset):
    def __init__(self, path):
        self.a = np.load(path, mmap_mode="r")  # (N, seq + 1) int32

    def __len__(self):
        return self.a.shape[0]

    def __getitem__(self, i):
        t = torch.from_numpy(np.asarray(self.a[i], dtype=np.int64))
        return t[:-1], t[1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--save", required=True)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--min-lr", type=float, default=3e-5)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=250000)
    ap.add_argument("--save-every", type=int, default=1000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    init_parallel_state(args.tp)
    torch.manual_seed(1337)
    rank = dist.get_rank()

    model = Llama(args.vocab, args.dim, args.heads, args.layers, args.ffn).cuda()
    model = DDP(model, device_ids=[local_rank], process_group=PS["dp_group"], gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def lr_lambda(s):
        if s < args.warmup:
            return (s + 1) / args.warmup
        p = min(1.0, (s - args.warmup) / (args.steps - args.warmup))
        return (args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * p))) / args.lr

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    step = 0
    ck = os.path.join(args.save, f"latest_tp{PS['tp_rank']:02d}.pt")
    if os.path.exists(ck):
        sd = torch.load(ck, map_location="cpu")
        model.module.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
        sched.load_state_dict(sd["sched"])
        step = sd["step"]

    ds = Packed(args.data)
    sampler = DistributedSampler(ds, num_replicas=PS["dp"], rank=PS["dp_rank"], shuffle=True, seed=1337)
    dl = DataLoader(ds, batch_size=args.mbs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    epoch, skipped, t0 = step // len(dl), 0, time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in dl:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y)
            if not torch.isfinite(loss):
                skipped += 1
                print(f"[rank {rank}] non-finite loss at step {step}, skipping batch ({skipped} so far)", flush=True)
                opt.zero_grad(set_to_none=True)
                continue
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1

            if step % 10 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG, group=PS["dp_group"])
                if rank == 0:
                    dt = (time.time() - t0) / 10
                    t0 = time.time()
                    tok_s = args.mbs * PS["dp"] * x.size(1) / dt
                    print(f"step {step} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{dt:.2f}s/step {tok_s:,.0f} tok/s", flush=True)
            if step % args.save_every == 0:
                if PS["dp_rank"] == 0:
                    os.makedirs(args.save, exist_ok=True)
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step}, ck + ".tmp")
                    os.replace(ck + ".tmp", ck)
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
