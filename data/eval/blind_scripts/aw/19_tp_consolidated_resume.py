"""Tensor-parallel (TP) x data-parallel GPT-NeoX style training with
consolidated checkpoints: shards are gathered over the TP group and written
as one full state dict, so a run can be resumed with a different TP size.

    torchrun --nproc_per_node=8 19_tp_consolidated_resume.py --tp 2 \
        --data /data/pile_neox/train.bin --save-dir ckpt/neox_1b --resume ckpt/neox_1b/latest.pt
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


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--val-data", default=None)
    p.add_argument("--save-dir", default="ckpt/neox")
    p.add_argument("--resume", default=None)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--vocab", type=int, default=50432)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2.5e-4)
    p.add_argument("--total-steps", type=int, default=143000)
    p.add_argument("--save-every", type=int, default=1000)
    return p.parse_args()


class Tokens(Dataset):
    def __init__(self, path, n):
        self.mm = np.memmap(path, dtype=np.uint16, mode="r")
        self.n = n

    def __len__(self):
        return (len(self.mm) - 1) // self.n

    def __getitem__(self, i):
        t = torch.from_numpy(self.mm[i * self.n:(i + 1) * self.n + 1].astype(np.int64))
        return t[:-1], t[1:]


class Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.g)
        return grad, None


class Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        x = x.contiguous()
        dist.all_reduce(x, group=g)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def tp_param(shape, dim, std):
    p = nn.Parameter(torch.randn(shape) * std)
    p.tp_dim = dim
    return p


class ParallelLayer(nn.Module):
    """GPT-NeoX parallel residual: x + attn(ln1(x)) + mlp(ln2(x)) with a single all-reduce."""

    def __init__(self, a, g):
        super().__init__()
        tp = dist.get_world_size(g)
        self.g, self.hd, self.lh = g, a.hidden // a.heads, a.heads // tp
        H = a.hidden
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.w_qkv = tp_param((3 * H // tp, H), 0, 0.02)
        self.w_o = tp_param((H, H // tp), 1, 0.02 / math.sqrt(2 * a.layers))
        self.w_in = tp_param((4 * H // tp, H), 0, 0.02)
        self.w_out = tp_param((H, 4 * H // tp), 1, 0.02 / math.sqrt(2 * a.layers))
        self.bias = nn.Parameter(torch.zeros(H))

    def forward(self, x):
        B, T, _ = x.shape
        h = Copy.apply(self.ln1(x), self.g)
        q, k, v = F.linear(h, self.w_qkv).view(B, T, self.lh, 3 * self.hd).transpose(1, 2).chunk(3, -1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        m = F.gelu(F.linear(Copy.apply(self.ln2(x), self.g), self.w_in))
        return x + Reduce.apply(F.linear(att, self.w_o) + F.linear(m, self.w_out), self.g) + self.bias


class NeoX(nn.Module):
    def __init__(self, a, g):
        super().__init__()
        self.embed = nn.Embedding(a.vocab, a.hidden)
        self.pos = nn.Embedding(a.seq_len, a.hidden)
        self.layers = nn.ModuleList([ParallelLayer(a, g) for _ in range(a.layers)])
        self.ln_f = nn.LayerNorm(a.hidden)
        self.unembed = nn.Linear(a.hidden, a.vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids) + self.pos(torch.arange(ids.size(1), device=ids.device))
        for l in self.layers:
            x = l(x)
        return self.unembed(self.ln_f(x))


def consolidated_state_dict(model, tp_group):
    """Full (unsharded) weights; must be called on every rank of the TP group."""
    tp = dist.get_world_size(tp_group)
    full = {}
    for n, p in model.named_parameters():
        t = p.detach()
        if hasattr(p, "tp_dim"):
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=tp_group)
            t = torch.cat(parts, dim=p.tp_dim)
        full[n] = t
    return full


def load_consolidated(model, full, tp_rank, tp):
    with torch.no_grad():
        for n, p in model.named_parameters():
            w = full[n]
            if hasattr(p, "tp_dim"):
                w = w.chunk(tp, dim=p.tp_dim)[tp_rank]
            p.copy_(w)


def main():
    a = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp_group = dp_group = None
    for i in range(world // a.tp):
        g = dist.new_group(list(range(i * a.tp, (i + 1) * a.tp)))
        if rank // a.tp == i:
            tp_group = g
    for j in range(a.tp):
        g = dist.new_group(list(range(j, world, a.tp)))
        if rank % a.tp == j:
            dp_group = g
    tp_rank, dp_rank, dp_size = rank % a.tp, rank // a.tp, world // a.tp
    dev = torch.device("cuda", local_rank)

    torch.manual_seed(1234 + tp_rank)
    model = NeoX(a, tp_group).to(dev)
    # replicated (non-TP) weights must be identical inside a TP group
    for n, p in model.named_parameters():
        if not hasattr(p, "tp_dim"):
            dist.broadcast(p.data, src=dp_rank * a.tp, group=tp_group)

    step = 0
    if a.resume and os.path.exists(a.resume):
        ckpt = torch.load(a.resume)
        load_consolidated(model, ckpt["model"], tp_rank, a.tp)
        step = ckpt["step"]
        if rank == 0:
            print(f"resumed from {a.resume} (saved with tp={ckpt['tp']}) at step {step}", flush=True)
        del ckpt

    ddp = DDP(model, device_ids=[local_rank], process_group=dp_group)
    opt = torch.optim.AdamW(ddp.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)
    lr_at = lambda s: a.lr * min(1.0, (s + 1) / 1430) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / a.total_steps))))

    ds = Tokens(a.data, a.seq_len)
    sampler = DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=0)
    loader = DataLoader(ds, a.batch_size, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = None
    if a.val_data:
        vds = Tokens(a.val_data, a.seq_len)
        val_loader = DataLoader(vds, a.batch_size, drop_last=True,
                                sampler=DistributedSampler(vds, num_replicas=dp_size, rank=dp_rank, shuffle=False))

    epoch = step // len(loader)
    skip = step % len(loader)
    t0 = time.time()
    while step < a.total_steps:
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if skip:
                skip -= 1
                continue
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(ddp(x).float().flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % 25 == 0 and rank == 0:
                print(f"step {step} loss {loss.item():.4f} lr {lr_at(step):.2e} {(time.time() - t0) / 25:.2f}s/it", flush=True)
                t0 = time.time()
            if step % a.save_every == 0:
                full = consolidated_state_dict(model, tp_group)
                if rank == 0:
                    os.makedirs(a.save_dir, exist_ok=True)
                    path = os.path.join(a.save_dir, f"step{step}.pt")
                    torch.save({"model": full, "step": step, "tp": a.tp}, path)
                    latest = os.path.join(a.save_dir, "latest.pt")
                    if os.path.lexists(latest):
                        os.remove(latest)
                    os.symlink(os.path.basename(path), latest)
                del full
                dist.barrier()
                if val_loader is not None:
                    ddp.eval()
                    tot = torch.zeros(2, device=dev)
                    with torch.no_grad():
                        for j, (vx, vy) in enumerate(val_loader):
                            if j == 50:
                                break
                            with torch.autocast("cuda", dtype=torch.bfloat16):
                                tot[0] += F.cross_entropy(ddp(vx.to(dev)).float().flatten(0, 1), vy.to(dev).flatten())
                            tot[1] += 1
                    dist.all_reduce(tot, group=dp_group)
                    ddp.train()
                    if rank == 0:
                        print(f"step {step} val loss {(tot[0] / tot[1]).item():.4f}", flush=True)
            if step >= a.total_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
