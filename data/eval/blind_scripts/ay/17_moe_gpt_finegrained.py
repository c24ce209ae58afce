"""Fine-grained MoE decoder (64 routed experts, top-4, 1 shared expert) trained data-parallel.

Experts are replicated on every GPU (no expert parallelism at this scale).

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        17_moe_gpt_finegrained.py --data /shared/tokens/dclm_20b --out /shared/runs/moe_64e
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


class Expert(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoELayer(nn.Module):
    def __init__(self, d, n_experts, top_k, expert_hidden):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, expert_hidden) for _ in range(n_experts))
        self.shared = Expert(d, expert_hidden * 2)

    def forward(self, x):
        B, T, D = x.shape
        flat = x.reshape(-1, D)
        probs = self.router(flat).float().softmax(-1)
        topw, topi = probs.topk(self.top_k, dim=-1)
        topw = (topw / topw.sum(-1, keepdim=True)).to(x.dtype)

        # switch-style load-balancing loss
        frac_tokens = F.one_hot(topi, self.n_experts).sum(1).float().mean(0)
        aux = self.n_experts * (frac_tokens * probs.mean(0)).sum() / self.top_k

        out = torch.zeros_like(flat)
        order = topi.flatten().argsort()
        counts = torch.bincount(topi.flatten(), minlength=self.n_experts).tolist()
        token_idx = (order // self.top_k)
        weights = topw.flatten()[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx = token_idx[start : start + n]
            out.index_add_(0, idx, self.experts[e](flat[idx]) * weights[start : start + n, None])
            start += n
        out = out + self.shared(flat)
        return out.view(B, T, D), aux


class Block(nn.Module):
    def __init__(self, d, heads, n_experts, top_k, expert_hidden):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.ln2 = nn.RMSNorm(d)
        self.moe = MoELayer(d, n_experts, top_k, expert_hidden)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, D))
        m, aux = self.moe(self.ln2(x))
        return x + m, aux


class MoEGPT(nn.Module):
    def __init__(self, vocab=50304, d=1024, layers=16, heads=16, n_experts=64, top_k=4, expert_hidden=352,
                 seq=2048):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, n_experts, top_k, expert_hidden) for _ in range(layers))
        self.ln_f = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.apply(lambda m: nn.init.normal_(m.weight, std=0.02) if isinstance(m, (nn.Linear, nn.Embedding)) else None)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        aux_total = 0.0
        for blk in self.blocks:
            x, aux = blk(x)
            aux_total = aux_total + aux
        return self.head(self.ln_f(x)), aux_total / len(self.blocks)


def batch_iter(path, bs, seq, rank, world, seed):
    data = np.memmap(path, dtype=np.uint16, mode="r")
    n_seq = (len(data) - 1) // seq
    rng = np.random.default_rng(seed)
    while True:
        perm = rng.permutation(n_seq)
        # contiguous per-rank slices of the shared permutation
        per_rank = len(perm) // world
        mine = perm[rank * per_rank : (rank + 1) * per_rank]
        for s in range(0, per_rank - bs + 1, bs):
            rows = np.stack([data[i * seq : i * seq + seq + 1] for i in np.sort(mine[s : s + bs])])
            t = torch.from_numpy(rows.astype(np.int64)).pin_memory()
            yield t[:, :-1], t[:, 1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40_000)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--save-every", type=int, default=2000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.backends.cuda.matmul.allow_tf32 = True

    model = MoEGPT(seq=args.seq).to(dev)
    ddp = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True, bucket_cap_mb=128)
    n_total = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    lr_at = lambda s: args.lr * min((s + 1) / args.warmup, 0.5 * (1 + math.cos(math.pi * s / args.steps)))

    step = 0
    ck_path = os.path.join(args.out, "ckpt.pt")
    if os.path.exists(ck_path):
        ck = torch.load(ck_path, map_location=dev)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step = ck["step"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"total params {n_total / 1e9:.2f}B, world {world}", flush=True)

    it = batch_iter(os.path.join(args.data, "train.bin"), args.bs, args.seq, rank, world, seed=step)
    t0 = time.perf_counter()
    while step < args.steps:
        x, y = next(it)
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, aux = ddp(x)
        lm = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        loss = lm + args.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1

        if step % 20 == 0:
            stats = torch.stack([lm.detach(), aux.detach().float()])
            dist.all_reduce(stats, op=dist.ReduceOp.AVG)
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / 20
            if rank == 0:
                tps = args.bs * args.seq * world / dt
                print(f"step {step} lm {stats[0].item():.4f} aux {stats[1].item():.4f} gnorm {gnorm.item():.2f} "
                      f"{tps / 1e3:.0f}k tok/s", flush=True)
            t0 = time.perf_counter()

        if step % args.save_every == 0:
            if rank == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ck_path + ".tmp")
                os.replace(ck_path + ".tmp", ck_path)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
