"""Video DiT with ring attention and hand-rolled data-parallel gradient sync.

No DDP wrapper: the model is small enough that one bucketed all-reduce per step is
fine, and keeping the raw module makes the ring attention's custom autograd simpler
to debug.  Context-parallel (ring) groups are consecutive ranks.

    torchrun --nproc_per_node=8 12_video_dit_ring_manual_sync.py --cp 4 --data /mnt/shared/latents/ucf_kinetics
"""
import argparse
import glob
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def ring_step(t, pos, nxt, prv, group):
    """Send t to the next rank and return the tensor received from the previous one."""
    buf = torch.empty_like(t)
    if pos % 2 == 0:
        dist.send(t.contiguous(), nxt, group=group)
        dist.recv(buf, prv, group=group)
    else:
        dist.recv(buf, prv, group=group)
        dist.send(t.contiguous(), nxt, group=group)
    return buf


class RingAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring):
        group, pos, size, nxt, prv = ring
        sc = q.size(-1) ** -0.5
        qf = q.float()
        out = torch.zeros_like(qf)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        kc, vc = k, v
        for i in range(size):
            s = qf @ kc.float().transpose(-1, -2) * sc
            bl = s.logsumexp(-1)
            m = torch.logaddexp(lse, bl)
            out = out * (lse - m).exp()[..., None] + ((s - bl[..., None]).exp() @ vc.float()) * (bl - m).exp()[..., None]
            lse = m
            if i < size - 1:
                kc = ring_step(kc, pos, nxt, prv, group)
                vc = ring_step(vc, pos, nxt, prv, group)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        group, pos, size, nxt, prv = ctx.ring
        sc = q.size(-1) ** -0.5
        qf, do = q.float(), do.float()
        delta = (do * out).sum(-1, keepdim=True)
        dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(qf), torch.zeros_like(qf)
        kc, vc = k, v
        for i in range(size):
            kf, vf = kc.float(), vc.float()
            p = (qf @ kf.transpose(-1, -2) * sc - lse[..., None]).exp()
            dv += p.transpose(-1, -2) @ do
            ds = p * (do @ vf.transpose(-1, -2) - delta)
            dq += ds @ kf * sc
            dk += ds.transpose(-1, -2) @ qf * sc
            # the dk/dv accumulators travel with the k/v block they belong to
            dk = ring_step(dk, pos, nxt, prv, group)
            dv = ring_step(dv, pos, nxt, prv, group)
            if i < size - 1:
                kc = ring_step(kc, pos, nxt, prv, group)
                vc = ring_step(vc, pos, nxt, prv, group)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.n1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.n2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.ada = nn.Linear(dim, 6 * dim)
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)

    def forward(self, x, c, ring):
        a, b, g, a2, b2, g2 = self.ada(F.silu(c))[:, None].chunk(6, -1)
        B, N, C = x.shape
        h = self.n1(x) * (1 + b) + a
        q, k, v = self.qkv(h).view(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = RingAttn.apply(q, k, v, ring).transpose(1, 2).reshape(B, N, C)
        x = x + g * self.proj(o)
        return x + g2 * self.mlp(self.n2(x) * (1 + b2) + a2)


class DiT(nn.Module):
    def __init__(self, in_dim, dim, depth, heads, n_classes):
        super().__init__()
        self.inp = nn.Linear(in_dim, dim)
        self.temb = nn.Sequential(nn.Linear(256, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.cemb = nn.Embedding(n_classes + 1, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.out = nn.Linear(dim, in_dim)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x, pe, t, y, ring):
        f = torch.exp(-math.log(10000) * torch.arange(128, device=t.device) / 128)
        c = self.temb(torch.cat([(t[:, None] * f).cos(), (t[:, None] * f).sin()], -1)) + self.cemb(y)
        h = self.inp(x) + pe
        for blk in self.blocks:
            h = blk(h, c, ring)
        return self.out(self.norm(h))


class Clips(Dataset):
    def __init__(self, root):
        self.files = sorted(glob.glob(os.path.join(root, "*.pt")))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = torch.load(self.files[i], map_location="cpu", weights_only=True)
        return d["tokens"].float(), int(d["label"])  # tokens: [N, C*pt*ph*pw], already patchified


def sincos(n, dim):
    p = torch.arange(n, dtype=torch.float32)[:, None]
    w = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    return torch.cat([torch.sin(p * w), torch.cos(p * w)], dim=1)


def allreduce_grads(params, world, bucket_mb=64):
    grads = [p.grad for p in params if p.grad is not None]
    bucket, size = [], 0
    for g in grads + [None]:
        if g is not None:
            bucket.append(g)
            size += g.numel() * g.element_size()
        if bucket and (g is None or size >= bucket_mb * 2 ** 20):
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat)
            flat.div_(world)
            for buf, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                buf.copy_(synced)
            bucket, size = [], 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16 * 16 * 16)
    ap.add_argument("--in-dim", type=int, default=4 * 1 * 2 * 2)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--classes", type=int, default=700)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=200000)
    ap.add_argument("--out", default="/mnt/shared/runs/dit_ring")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    cp = args.cp

    ring = None
    for g0 in range(0, world, cp):
        members = list(range(g0, g0 + cp))
        grp = dist.new_group(members)
        if rank in members:
            p = rank - g0
            ring = (grp, p, cp, members[(p + 1) % cp], members[(p - 1) % cp])
    cp_pos, dp_rank, dp_size = ring[1], rank // cp, world // cp
    n_loc = args.tokens // cp

    model = DiT(args.in_dim, args.dim, args.depth, args.heads, args.classes).cuda()
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src=0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    pe = sincos(args.tokens, args.dim)[cp_pos * n_loc:(cp_pos + 1) * n_loc].cuda()[None]
    abar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64), 0).float().cuda()

    ds = Clips(args.data)
    sampler = DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)

    torch.manual_seed(args.seed + rank)  # independent noise per shard
    shared = torch.Generator(device="cuda")  # same stream for the whole CP group
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step, epoch = 0, 0
    tic = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x0, y in loader:
            x0 = x0[:, cp_pos * n_loc:(cp_pos + 1) * n_loc].cuda(non_blocking=True)
            y = y.cuda(non_blocking=True)
            shared.manual_seed(args.seed * 1_000_003 + dp_rank * 10_007 + step)
            t = torch.randint(0, 1000, (x0.size(0),), device="cuda", generator=shared)
            drop = torch.rand(x0.size(0), device="cuda", generator=shared) < 0.1
            y = y.masked_fill(drop, args.classes)
            eps = torch.randn_like(x0)
            ab = abar[t][:, None, None]
            xt = ab.sqrt() * x0 + (1 - ab).sqrt() * eps
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(xt, pe, t.float(), y, ring)
            loss = F.mse_loss(pred.float(), eps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            allreduce_grads(params, world)
            gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1

            if step % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l)
                if rank == 0:
                    print(f"step {step} loss {l.item() / world:.4f} gnorm {gn.item():.3f} "
                          f"{(time.time() - tic) / 100:.3f}s/it", flush=True)
                tic = time.time()
            if step % 5000 == 0:
                if rank == 0:
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                               os.path.join(args.out, f"ckpt_{step:07d}.pt"))
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
