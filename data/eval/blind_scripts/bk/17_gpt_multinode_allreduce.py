"""
GPT-2 (124M) pre-training on OpenWebText tokens, two 8-GPU nodes.

Gradient accumulation with a single flattened all_reduce at the end of each
accumulation window; weights are broadcast from rank 0 after init/resume.

node 0:  torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=10.1.0.11 --master_port=29500 \
             17_gpt_multinode_allreduce.py --data /shared/owt --out /shared/runs/gpt2_124m
node 1:  same with --node_rank=1
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


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="dir with train.bin / val.bin (uint16)")
    p.add_argument("--out", required=True)
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--micro-bs", type=int, default=12)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--max-iters", type=int, default=60000)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min-lr", type=float, default=6e-5)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--eval-iters", type=int, default=50)
    return p.parse_args()


class CausalSelfAttention(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, h)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, block, n_layer, n_head, d):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.blocks = nn.ModuleList([Block(d, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def get_batch(data, bs, block, rng, device):
    ix = rng.integers(0, len(data) - block - 1, size=bs)
    x = torch.from_numpy(np.stack([data[i:i + block] for i in ix]).astype(np.int64))
    y = torch.from_numpy(np.stack([data[i + 1:i + 1 + block] for i in ix]).astype(np.int64))
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


def lr_at(it, a):
    if it < a.warmup:
        return a.lr * (it + 1) / a.warmup
    r = min(1.0, (it - a.warmup) / (a.max_iters - a.warmup))
    return a.min_lr + 0.5 * (1 + math.cos(math.pi * r)) * (a.lr - a.min_lr)


def allreduce_grads(params, world):
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(world)
    o = 0
    for g in grads:
        g.copy_(flat[o:o + g.numel()].view_as(g))
        o += g.numel()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://",
                            world_size=torch.cuda.device_count(), rank=int(os.environ["RANK"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cuda.matmul.allow_tf32 = True

    train = np.memmap(os.path.join(args.data, "train.bin"), dtype=np.uint16, mode="r")
    val = np.memmap(os.path.join(args.data, "val.bin"), dtype=np.uint16, mode="r")
    rng = np.random.default_rng(1337 + rank)  # independent random windows per rank

    model = GPT(50304, args.block, args.n_layer, args.n_head, args.n_embd).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=True)

    it0 = 0
    ckpt_path = os.path.join(args.out, "ckpt.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        it0 = ck["iter"]
    with torch.no_grad():
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        tokens_per_iter = args.micro_bs * args.block * args.accum * world
        print(f"world {world}, {tokens_per_iter:,} tokens/iter, resume at {it0}", flush=True)

    t0 = time.time()
    for it in range(it0, args.max_iters):
        lr = lr_at(it, args)
        for g in opt.param_groups:
            g["lr"] = lr
        model.train()
        loss_acc = torch.zeros((), device=device)
        for _ in range(args.accum):
            x, y = get_batch(train, args.micro_bs, args.block, rng, device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y) / args.accum
            loss.backward()
            loss_acc += loss.detach()
        allreduce_grads(params, world)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

        if it % 10 == 0:
            dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)
            if rank == 0:
                dt = (time.time() - t0) / 10
                t0 = time.time()
                print(f"iter {it} loss {loss_acc.item():.4f} lr {lr:.2e} {dt * 1000:.0f}ms/iter", flush=True)

        if (it + 1) % args.eval_every == 0:
            model.eval()
            vl = torch.zeros((), device=device)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                for _ in range(args.eval_iters):
                    x, y = get_batch(val, args.micro_bs, args.block, rng, device)
                    vl += model(x, y)
            vl /= args.eval_iters
            dist.all_reduce(vl, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"iter {it + 1} val loss {vl.item():.4f}", flush=True)
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "iter": it + 1,
                            "args": vars(args)}, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
