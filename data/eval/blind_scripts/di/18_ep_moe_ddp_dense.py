"""Expert-parallel MoE LM on one 8-GPU node: DDP for the dense weights, experts sharded.

DDP is told to ignore the expert weights (each rank owns different experts, so
they must not be broadcast at construction nor averaged). Their gradients come
back through the all_to_all in backward and are rescaled by hand.

    torchrun --standalone --nproc_per_node=8 18_ep_moe_ddp_dense.py --data /data/owt_gpt2 --out ckpt/ep8_ddp
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


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--cf-train", type=float, default=1.25)
    p.add_argument("--cf-eval", type=float, default=2.0)
    p.add_argument("--bs", type=int, default=12)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--iters", type=int, default=100000)
    p.add_argument("--aux", type=float, default=0.01)
    p.add_argument("--zl", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--save-every", type=int, default=2000)
    return p.parse_args()


class Bin(Dataset):
    def __init__(self, path, ctx):
        self.m = np.memmap(path, dtype=np.uint16, mode="r")
        self.ctx = ctx

    def __len__(self):
        return (len(self.m) - 1) // self.ctx

    def __getitem__(self, i):
        t = torch.from_numpy(self.m[i * self.ctx:(i + 1) * self.ctx + 1].astype(np.int64))
        return t[:-1], t[1:]


class _A2A(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits):
        ctx.splits = (out_splits, in_splits)
        y = x.new_empty(sum(out_splits), x.size(-1))
        dist.all_to_all_single(y, x.contiguous(), out_splits, in_splits)
        return y

    @staticmethod
    def backward(ctx, gy):
        out_splits, in_splits = ctx.splits
        gx = gy.new_empty(sum(in_splits), gy.size(-1))
        dist.all_to_all_single(gx, gy.contiguous(), in_splits, out_splits)
        return gx, None, None


class ShardedMoE(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.W = dist.get_world_size()
        self.E, self.k = a.experts, a.k
        self.cf_train, self.cf_eval = a.cf_train, a.cf_eval
        self.local = a.experts // self.W
        self.router = nn.Linear(a.d, a.experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(a.d, 4 * a.d), nn.GELU(), nn.Linear(4 * a.d, a.d)) for _ in range(self.local))
        self.stats = None

    def forward(self, x):
        B, T, D = x.shape
        h = x.reshape(-1, D)
        N = h.size(0)
        logits = self.router(h).float()
        probs = logits.softmax(-1)
        gw, ge = probs.topk(self.k, -1)
        gw = gw / gw.sum(-1, keepdim=True)
        aux = self.E * (F.one_hot(ge[:, 0], self.E).float().mean(0) * probs.mean(0)).sum()
        zl = logits.logsumexp(-1).pow(2).mean()

        cap = math.ceil((self.cf_train if self.training else self.cf_eval) * self.k * N / self.E)
        e = ge.t().reshape(-1)
        w = gw.t().reshape(-1)
        t = torch.arange(N, device=h.device).repeat(self.k)
        pos = (F.one_hot(e, self.E).cumsum(0) - 1).gather(1, e[:, None]).squeeze(1)
        keep = pos < cap
        e, w, t = e[keep], w[keep], t[keep]
        o = e.argsort(stable=True)
        e, w, t = e[o], w[o], t[o]

        counts = torch.bincount(e, minlength=self.E)
        counts_in = torch.empty_like(counts)
        dist.all_to_all_single(counts_in, counts)
        counts_in = counts_in.view(self.W, self.local)
        send = counts.view(self.W, self.local).sum(1).tolist()
        recv = counts_in.sum(1).tolist()

        xr = _A2A.apply(h[t], recv, send)
        which = torch.arange(self.local, device=h.device).repeat(self.W).repeat_interleave(counts_in.reshape(-1))
        perm = which.argsort(stable=True)
        ys = [ex(c) for ex, c in zip(self.experts, xr[perm].split(counts_in.sum(0).tolist()))]
        yr = torch.cat(ys)[perm.argsort()]
        yb = _A2A.apply(yr, send, recv)
        out = torch.zeros_like(h).index_add(0, t, (yb * w[:, None]).to(h.dtype))

        self.stats = torch.stack([counts.sum().float(), torch.tensor(float(N * self.k), device=h.device)])
        return out.view(B, T, D), aux, zl


class Block(nn.Module):
    def __init__(self, a, moe):
        super().__init__()
        self.h = a.heads
        self.n1, self.n2 = nn.LayerNorm(a.d), nn.LayerNorm(a.d)
        self.qkv = nn.Linear(a.d, 3 * a.d)
        self.proj = nn.Linear(a.d, a.d)
        self.is_moe = moe
        self.ff = ShardedMoE(a) if moe else nn.Sequential(nn.Linear(a.d, 4 * a.d), nn.GELU(), nn.Linear(4 * a.d, a.d))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))
        if self.is_moe:
            y, aux, zl = self.ff(self.n2(x))
            return x + y, aux, zl
        return x + self.ff(self.n2(x)), 0.0, 0.0


class GPTMoE(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.wte = nn.Embedding(a.vocab, a.d)
        self.wpe = nn.Embedding(a.ctx, a.d)
        self.blocks = nn.ModuleList(Block(a, i % 2 == 1) for i in range(a.layers))
        self.ln = nn.LayerNorm(a.d)
        self.head = nn.Linear(a.d, a.vocab, bias=False)
        self.head.weight = self.wte.weight

    def moe_layers(self):
        return [b.ff for b in self.blocks if b.is_moe]

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        aux = zl = 0.0
        for b in self.blocks:
            x, a_, z_ = b(x)
            aux, zl = aux + a_, zl + z_
        n = len(self.moe_layers())
        return self.head(self.ln(x)), aux / n, zl / n


def expert_names(model):
    return [n for n, _ in model.named_parameters() if ".ff.experts." in n]


def main():
    a = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    assert a.experts % world == 0

    # seed with the rank so every shard of experts starts different; DDP then
    # overwrites the dense weights with rank 0's copy
    torch.manual_seed(1234 + rank)
    net = GPTMoE(a).to(dev)
    ignore = expert_names(net)
    DDP._set_params_and_buffers_to_ignore_for_model(net, ignore)
    model = DDP(net, device_ids=[local_rank])
    expert_params = [p for n, p in net.named_parameters() if n in set(ignore)]

    opt = torch.optim.AdamW(net.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    os.makedirs(a.out, exist_ok=True)
    dense_path = os.path.join(a.out, "dense.pt")
    shard_path = os.path.join(a.out, f"experts_{rank}_of_{world}.pt")
    it = 0
    if os.path.exists(dense_path):
        dense = torch.load(dense_path, map_location=dev)
        shard = torch.load(shard_path, map_location=dev)
        net.load_state_dict({**dense["model"], **shard["model"]})
        opt.load_state_dict(shard["opt"])
        it = dense["it"]

    train = Bin(os.path.join(a.data, "train.bin"), a.ctx)
    val = Bin(os.path.join(a.data, "val.bin"), a.ctx)
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    dl = DataLoader(train, a.bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    vdl = DataLoader(val, a.bs, sampler=DistributedSampler(val, shuffle=False, drop_last=True), num_workers=2)

    def lr_at(i):
        if i < a.warmup:
            return a.lr * (i + 1) / a.warmup
        return a.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (i - a.warmup) / (a.iters - a.warmup)))))

    ep = it // len(dl)
    t0 = time.time()
    while it < a.iters:
        sampler.set_epoch(ep)
        for x, y in dl:
            for g in opt.param_groups:
                g["lr"] = lr_at(it)
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, aux, zl = model(x)
                ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                loss = ce + a.aux * aux + a.zl * zl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            # DDP averaged the dense grads; expert grads hold the sum over all ranks' tokens
            for p in expert_params:
                p.grad.div_(world)
            opt.step()
            it += 1

            if it % 20 == 0:
                kept = torch.stack([m.stats for m in net.moe_layers()]).sum(0)
                r = torch.cat([torch.stack([ce.detach(), aux.detach()]), kept])
                dist.all_reduce(r)
                if rank == 0:
                    print(f"it {it} ce {r[0] / world:.4f} aux {r[1] / world:.4f} "
                          f"dropped {1 - r[2] / r[3]:.2%} lr {lr_at(it):.2e} {time.time() - t0:.0f}s", flush=True)

            if it % a.eval_every == 0:
                model.eval()
                s = torch.zeros(2, device=dev)
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    for j, (vx, vy) in enumerate(vdl):
                        if j == 25:
                            break
                        vl, _, _ = net(vx.to(dev))
                        s[0] += F.cross_entropy(vl.float().flatten(0, 1), vy.to(dev).flatten(), reduction="sum")
                        s[1] += vy.numel()
                dist.all_reduce(s)
                model.train()
                if rank == 0:
                    print(f"it {it} val_loss {s[0] / s[1]:.4f}", flush=True)

            if it % a.save_every == 0:
                sd = net.state_dict()
                torch.save({"model": {k: v for k, v in sd.items() if k in set(ignore)}, "opt": opt.state_dict()},
                           shard_path)
                if rank == 0:
                    torch.save({"model": {k: v for k, v in sd.items() if k not in set(ignore)}, "it": it},
                               dense_path)
                dist.barrier()
            if it >= a.iters:
                break
        ep += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
