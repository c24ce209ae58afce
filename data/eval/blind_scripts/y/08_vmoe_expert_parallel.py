"""Sparse ViT (V-MoE style) with expert parallelism, written by hand.

Experts are sharded over ranks (num_experts / world_size per rank) and tokens
are dispatched with all_to_all. Dense weights are replicated and their
gradients are all-reduced manually after backward (DDP would also average the
expert weights, which are different on every rank).

    torchrun --nproc_per_node=8 vmoe.py --data /data/imagenet100 --num-experts 16
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits):
        ctx.splits = (out_splits, in_splits)
        y = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(y, x.contiguous(), out_splits, in_splits)
        return y

    @staticmethod
    def backward(ctx, gy):
        out_splits, in_splits = ctx.splits
        gx = gy.new_empty(sum(in_splits), *gy.shape[1:])
        dist.all_to_all_single(gx, gy.contiguous(), in_splits, out_splits)
        return gx, None, None


class MoEMLP(nn.Module):
    def __init__(self, dim, hidden, num_experts):
        super().__init__()
        self.ws, self.rank = dist.get_world_size(), dist.get_rank()
        self.E = num_experts
        self.n_local = num_experts // self.ws
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(self.n_local, dim, hidden) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(self.n_local, hidden, dim) * hidden ** -0.5)
        self.w1.expert = self.w2.expert = True

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.gate(x).float().softmax(-1)
        top_p, top_e = probs.max(-1)
        load = torch.bincount(top_e, minlength=self.E).float() / top_e.numel()
        aux = self.E * (load * probs.mean(0)).sum()

        order = top_e.argsort()
        counts = torch.bincount(top_e, minlength=self.E)
        # exchange per-expert counts first so every rank knows what it will receive
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts)
        recv_counts = recv_counts.view(self.ws, self.n_local)       # [source rank, local expert]
        in_splits = counts.view(self.ws, self.n_local).sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()

        tokens = AllToAll.apply(x[order], out_splits, in_splits)
        # tokens arrive grouped by source rank, and inside each group sorted by expert
        chunks = tokens.split(recv_counts.flatten().tolist())
        outs = []
        for idx, chunk in enumerate(chunks):
            e = idx % self.n_local
            h = F.gelu(chunk @ self.w1[e].to(chunk.dtype))
            outs.append(h @ self.w2[e].to(chunk.dtype))
        y = torch.cat(outs) if outs else tokens
        y = AllToAll.apply(y, in_splits, out_splits)
        out = torch.empty_like(y)
        out[order] = y
        out = out * top_p.unsqueeze(-1).to(out.dtype)
        return out.view(shape), aux


class Block(nn.Module):
    def __init__(self, dim, heads, moe, num_experts):
        super().__init__()
        self.n1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.n2 = nn.LayerNorm(dim)
        self.moe = moe
        self.mlp = MoEMLP(dim, 4 * dim, num_experts) if moe else nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.n1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        if self.moe:
            h, aux = self.mlp(self.n2(x))
        else:
            h, aux = self.mlp(self.n2(x)), x.new_zeros((), dtype=torch.float32)
        return x + h, aux


class VMoE(nn.Module):
    def __init__(self, num_classes, num_experts, dim=384, depth=12, heads=6, patch=16, img=224):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, (img // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim, heads, i % 2 == 1, num_experts) for i in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], 1) + self.pos
        aux = 0.0
        for b in self.blocks:
            x, a = b(x)
            aux = aux + a
        return self.head(self.norm(x)[:, 0]), aux


def allreduce_dense_grads(model, ws):
    dense = [p.grad for p in model.parameters() if p.grad is not None and not getattr(p, "expert", False)]
    for bucket_start in range(0, len(dense), 32):
        bucket = dense[bucket_start:bucket_start + 32]
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.AVG)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    for p in model.parameters():
        if getattr(p, "expert", False) and p.grad is not None:
            p.grad.div_(ws)  # expert grads sum over every rank's tokens; scale like the dense mean


@torch.no_grad()
def evaluate(model, loader, device, n_valid, rank, ws):
    model.eval()
    stats = torch.zeros(2, device=device)
    k = 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, _ = model(x)
        # DistributedSampler pads the tail by repeating samples; drop those from the count
        pos = rank + ws * (k + torch.arange(x.size(0), device=device))
        valid = pos < n_valid
        stats[0] += ((logits.argmax(-1) == y) & valid).sum()
        stats[1] += valid.sum()
        k += x.size(0)
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--num-classes", type=int, default=100)
    ap.add_argument("--num-experts", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--aux-weight", type=float, default=0.01)
    ap.add_argument("--out", default="runs/vmoe")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, ws = dist.get_rank(), dist.get_world_size()
    assert args.num_experts % ws == 0
    device = torch.device("cuda", local_rank)

    norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), T.Compose([
        T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    val_ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), T.Compose([
        T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    # every rank must run the same number of eval batches: each forward does all_to_all
    val_loader = DataLoader(val_ds, 250, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=8, pin_memory=True)

    torch.manual_seed(0)
    model = VMoE(args.num_classes, args.num_experts).to(device)
    # dense weights start equal everywhere; experts get a rank-specific init
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    for p in model.parameters():
        if getattr(p, "expert", False):
            p.data.copy_(torch.randn(p.shape, generator=g, device=device) * p.shape[1] ** -0.5)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    steps = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps, pct_start=0.05)

    os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, aux = model(x)
                loss = F.cross_entropy(logits.float(), y, label_smoothing=0.1) + args.aux_weight * aux
            opt.zero_grad(set_to_none=True)
            loss.backward()
            allreduce_dense_grads(model, ws)
            opt.step()
            sched.step()
            if i % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} it {i}/{len(train_loader)} loss {l.item():.4f} aux {aux.item():.3f}")

        acc = evaluate(model, val_loader, device, len(val_ds), rank, ws)
        # each rank holds different experts, so every rank writes its own shard
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                    "world_size": ws}, os.path.join(args.out, f"ckpt_rank{rank}_of{ws}.pt"))
        if rank == 0:
            print(f"epoch {epoch} val acc {acc:.4f}")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
