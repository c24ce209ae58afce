"""Domain-adaptive fine-tuning of a tensor-parallel GPT with *consolidated* checkpoints.

Checkpoints hold the full (unsharded) weights so they can be resumed with any
TP degree and exported to Hugging Face format without a merge step.

    torchrun --nproc_per_node=8 17_tp_consolidated_ckpt.py --tp 4 --data data/med_train.bin \
        --resume ckpt/med_gpt/consolidated_last.pt
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

S = {}


def setup_parallel(tp):
    world, rank = dist.get_world_size(), dist.get_rank()
    S.update(tp=tp, dp=world // tp, tp_rank=rank % tp, dp_rank=rank // tp, rank=rank)
    for i in range(world // tp):
        g = dist.new_group(list(range(i * tp, (i + 1) * tp)))
        if i == S["dp_rank"]:
            S["tp_group"] = g
    for j in range(tp):
        g = dist.new_group(list(range(j, world, tp)))
        if j == S["tp_rank"]:
            S["dp_group"] = g


class _C(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=S["tp_group"])
        return g


class _R(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        dist.all_reduce(x, group=S["tp_group"])
        return x

    @staticmethod
    def backward(ctx, g):
        return g


def tp_param(shape, split_dim, std=0.02):
    full = torch.randn(*shape) * std if std else torch.zeros(*shape)
    p = nn.Parameter(full.chunk(S["tp"], split_dim)[S["tp_rank"]].clone())
    p.split_dim = split_dim
    return p


class Attn(nn.Module):
    def __init__(self, d, nh):
        super().__init__()
        self.nh, self.hd = nh // S["tp"], d // nh
        self.qkv_w, self.qkv_b = tp_param((3 * d, d), 0), tp_param((3 * d,), 0, std=0)
        self.o_w, self.o_b = tp_param((d, d), 1), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        B, T, _ = x.shape
        qkv = F.linear(_C.apply(x), self.qkv_w, self.qkv_b).view(B, T, self.nh, 3 * self.hd).transpose(1, 2)
        q, k, v = qkv.split(self.hd, -1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        return _R.apply(F.linear(y, self.o_w)) + self.o_b


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc_w, self.fc_b = tp_param((4 * d, d), 0), tp_param((4 * d,), 0, std=0)
        self.proj_w, self.proj_b = tp_param((d, 4 * d), 1), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        h = F.gelu(F.linear(_C.apply(x), self.fc_w, self.fc_b), approximate="tanh")
        return _R.apply(F.linear(h, self.proj_w)) + self.proj_b


class Block(nn.Module):
    def __init__(self, d, nh):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(d), Attn(d, nh), nn.LayerNorm(d), MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab, d, nh, nl, ctx):
        super().__init__()
        self.wte = tp_param((vocab, d), 0)
        self.vpart = vocab // S["tp"]
        self.v0 = S["tp_rank"] * self.vpart
        self.wpe = nn.Parameter(torch.randn(ctx, d) * 0.01)
        self.h = nn.ModuleList(Block(d, nh) for _ in range(nl))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx, tgt):
        off = idx - self.v0
        oob = (off < 0) | (off >= self.vpart)
        x = F.embedding(off.masked_fill(oob, 0), self.wte).masked_fill(oob[..., None], 0.0)
        x = _R.apply(x) + self.wpe[: idx.size(1)]
        for b in self.h:
            x = b(x)
        z = F.linear(_C.apply(self.ln_f(x)), self.wte).float()
        with torch.no_grad():
            m = z.amax(-1, keepdim=True)
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=S["tp_group"])
        z = z - m
        lse = _R.apply(z.exp().sum(-1)).log()
        inside = (tgt >= self.v0) & (tgt < self.v0 + self.vpart)
        zt = z.gather(-1, (tgt - self.v0).clamp(0, self.vpart - 1)[..., None]).squeeze(-1) * inside
        return (lse - _R.apply(zt)).mean()


@torch.no_grad()
def consolidated_state(model):
    """Full tensors, gathered over the TP group (called by every rank)."""
    out = {}
    for name, p in model.named_parameters():
        dim = getattr(p, "split_dim", None)
        if dim is None:
            out[name] = p.detach().clone()
        else:
            parts = [torch.empty_like(p) for _ in range(S["tp"])]
            dist.all_gather(parts, p.detach().contiguous(), group=S["tp_group"])
            out[name] = torch.cat(parts, dim=dim)
    return out


@torch.no_grad()
def load_consolidated(model, full):
    for name, p in model.named_parameters():
        t = full[name]
        dim = getattr(p, "split_dim", None)
        if dim is not None:
            t = t.chunk(S["tp"], dim)[S["tp_rank"]]
        p.copy_(t)


class Bin(Dataset):
    def __init__(self, path, ctx):
        self.a, self.ctx = np.memmap(path, dtype=np.uint16, mode="r"), ctx

    def __len__(self):
        return (len(self.a) - 1) // self.ctx

    def __getitem__(self, i):
        t = torch.from_numpy(self.a[i * self.ctx:(i + 1) * self.ctx + 1].astype(np.int64))
        return t[:-1], t[1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--resume", default="")
    ap.add_argument("--save-dir", default="ckpt/med_gpt")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=6e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--save-every", type=int, default=1000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    setup_parallel(args.tp)
    torch.manual_seed(0)

    model = GPT(args.vocab, args.d, args.heads, args.layers, args.ctx).cuda()
    step = 0
    if args.resume:
        ck = torch.load(args.resume)
        load_consolidated(model, ck["model"])
        step = ck["step"]
        del ck
    ddp = DDP(model, device_ids=[local_rank], process_group=S["dp_group"])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    ds = Bin(args.data, args.ctx)
    sampler = DistributedSampler(ds, num_replicas=S["dp"], rank=S["dp_rank"], shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    total = args.epochs * len(dl)
    lr_at = lambda s: args.lr * min(1.0, (s + 1) / 200) * 0.5 * (1 + math.cos(math.pi * s / total))

    for epoch in range(step // len(dl), args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        for x, y in dl:
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp(x.cuda(non_blocking=True), y.cuda(non_blocking=True))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % 20 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG, group=S["dp_group"])
                if S["rank"] == 0:
                    print(f"epoch {epoch} step {step}/{total} loss {l.item():.4f}", flush=True)
            if step % args.save_every == 0:
                state = consolidated_state(model)  # collective over the TP group
                if S["rank"] == 0:
                    os.makedirs(args.save_dir, exist_ok=True)
                    torch.save({"model": state, "step": step, "tp_at_save": args.tp},
                               os.path.join(args.save_dir, "consolidated_last.pt"))
                del state
                dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
