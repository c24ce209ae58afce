#!/usr/bin/env python
"""Expert-parallel MoE language model pretraining.

Experts are sharded over an expert-parallel (EP) group. Replicas of the same
expert shard live in different EP groups and are averaged over the
expert-data-parallel group; dense weights are averaged over the whole world.

    torchrun --nproc_per_node=8 01_moe_lm_ep_alltoall.py \
        --train-bin /data/owt/train.bin --val-bin /data/owt/val.bin --ep-size 4
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-bin", required=True)
    p.add_argument("--val-bin", required=True)
    p.add_argument("--out-dir", default="checkpoints/moe_lm")
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--n-layers", type=int, default=12)
    p.add_argument("--n-heads", type=int, default=12)
    p.add_argument("--num-experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--ep-size", type=int, default=4)
    p.add_argument("--moe-every", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--min-lr", type=float, default=3e-5)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--aux-weight", type=float, default=1e-2)
    p.add_argument("--z-weight", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--eval-iters", type=int, default=50)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--save-every", type=int, default=5000)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


class TokenBlocks(Dataset):
    def __init__(self, path, seq_len):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len
        self.n = (len(self.data) - 1) // seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = i * self.seq_len
        chunk = torch.from_numpy(self.data[s:s + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


def build_groups(world_size, ep_size):
    """Every rank has to create every group, in the same order."""
    rank = dist.get_rank()
    ep_group = edp_group = None
    for start in range(0, world_size, ep_size):
        ranks = list(range(start, start + ep_size))
        g = dist.new_group(ranks)
        if rank in ranks:
            ep_group = g
    for offset in range(ep_size):
        ranks = list(range(offset, world_size, ep_size))
        g = dist.new_group(ranks)
        if rank in ranks:
            edp_group = g
    return ep_group, edp_group


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.group = group
        ctx.output_splits = output_splits
        ctx.input_splits = input_splits
        out = x.new_empty((sum(output_splits), x.size(1)))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=output_splits,
                               input_split_sizes=input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_in = grad_out.new_empty((sum(ctx.input_splits), grad_out.size(1)))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), output_split_sizes=ctx.input_splits,
                               input_split_sizes=ctx.output_splits, group=ctx.group)
        return grad_in, None, None, None


class Expert(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff)
        self.w2 = nn.Linear(d_ff, d_model)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class MoELayer(nn.Module):
    def __init__(self, d_model, d_ff, num_experts, top_k, capacity_factor, ep_group):
        super().__init__()
        self.ep_group = ep_group
        self.ep_size = dist.get_world_size(ep_group)
        self.ep_rank = dist.get_rank(ep_group)
        assert num_experts % self.ep_size == 0
        self.num_experts = num_experts
        self.local_experts = num_experts // self.ep_size
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d_model, d_ff) for _ in range(self.local_experts))

    def forward(self, x):
        B, T, D = x.shape
        xf = x.reshape(-1, D)
        N = xf.size(0)
        E, K = self.num_experts, self.top_k

        with torch.autocast("cuda", enabled=False):
            logits = self.router(xf.float())
        probs = logits.softmax(dim=-1)
        topk_p, topk_idx = probs.topk(K, dim=-1)
        topk_p = topk_p / topk_p.sum(dim=-1, keepdim=True)

        # Switch-style balance loss on the first choice + router z-loss
        density = F.one_hot(topk_idx[:, 0], E).float().mean(0)
        aux_loss = E * (density * probs.mean(0)).sum()
        z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()

        # first choices get priority for capacity slots
        capacity = int(math.ceil(self.capacity_factor * N * K / E))
        flat_expert = topk_idx.t().reshape(-1)
        flat_gate = topk_p.t().reshape(-1)
        flat_token = torch.arange(N, device=x.device).repeat(K)
        pos = (F.one_hot(flat_expert, E).cumsum(0) - 1).gather(1, flat_expert[:, None]).squeeze(1)
        keep = pos < capacity
        dropped = 1.0 - keep.float().mean()

        expert_id = flat_expert[keep]
        order = torch.argsort(expert_id, stable=True)
        expert_id = expert_id[order]
        token_id = flat_token[keep][order]
        gate = flat_gate[keep][order]

        send_counts = torch.bincount(expert_id, minlength=E)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        recv_counts = recv_counts.view(self.ep_size, self.local_experts)
        input_splits = send_counts.view(self.ep_size, self.local_experts).sum(1).tolist()
        output_splits = recv_counts.sum(1).tolist()

        received = _AllToAll.apply(xf[token_id], output_splits, input_splits, self.ep_group)

        # rows arrive as [source rank][local expert]; regroup them by local expert
        local_ids = torch.arange(self.local_experts, device=x.device).repeat(self.ep_size)
        row_expert = torch.repeat_interleave(local_ids, recv_counts.reshape(-1))
        perm = torch.argsort(row_expert, stable=True)
        per_expert = recv_counts.sum(0).tolist()
        chunks = received[perm].split(per_expert)
        out = torch.cat([expert(c) for expert, c in zip(self.experts, chunks)], dim=0)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=x.device)
        out = out[inv]

        returned = _AllToAll.apply(out, input_splits, output_splits, self.ep_group)
        y = torch.zeros(N, D, dtype=returned.dtype, device=x.device)
        y.index_add_(0, token_id, returned * gate.unsqueeze(1).to(returned.dtype))
        return y.view(B, T, D), aux_loss, z_loss, dropped.detach()


class Block(nn.Module):
    def __init__(self, args, use_moe, ep_group):
        super().__init__()
        self.n_heads = args.n_heads
        self.ln1 = nn.LayerNorm(args.d_model)
        self.qkv = nn.Linear(args.d_model, 3 * args.d_model)
        self.proj = nn.Linear(args.d_model, args.d_model)
        self.ln2 = nn.LayerNorm(args.d_model)
        self.use_moe = use_moe
        if use_moe:
            self.ffn = MoELayer(args.d_model, 4 * args.d_model, args.num_experts, args.top_k,
                                args.capacity_factor, ep_group)
        else:
            self.ffn = Expert(args.d_model, 4 * args.d_model)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, C))
        if self.use_moe:
            h, aux, z, dropped = self.ffn(self.ln2(x))
        else:
            h, aux, z, dropped = self.ffn(self.ln2(x)), 0.0, 0.0, None
        return x + h, aux, z, dropped


class MoEGPT(nn.Module):
    def __init__(self, args, ep_group):
        super().__init__()
        self.tok = nn.Embedding(args.vocab_size, args.d_model)
        self.pos = nn.Embedding(args.seq_len, args.d_model)
        self.blocks = nn.ModuleList(
            Block(args, (i + 1) % args.moe_every == 0, ep_group) for i in range(args.n_layers))
        self.ln_f = nn.LayerNorm(args.d_model)
        self.head = nn.Linear(args.d_model, args.vocab_size, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        aux_total, z_total, drops = 0.0, 0.0, []
        for blk in self.blocks:
            x, aux, z, dropped = blk(x)
            aux_total = aux_total + aux
            z_total = z_total + z
            if dropped is not None:
                drops.append(dropped)
        return self.head(self.ln_f(x)), aux_total, z_total, torch.stack(drops).mean()


def sync_gradients(model, edp_group, world_size):
    dense = [p for n, p in model.named_parameters() if ".experts." not in n]
    expert = [p for n, p in model.named_parameters() if ".experts." in n]
    for params, group in ((dense, None), (expert, edp_group)):
        grads = [p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        # expert grads already hold the contributions of the whole EP group
        flat.div_(world_size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def clip_grad_norm_ep(model, max_norm, ep_group):
    """Global grad norm: dense grads are identical everywhere after the sync,
    expert shards differ inside an EP group."""
    dense_sq = torch.zeros((), device="cuda")
    expert_sq = torch.zeros((), device="cuda")
    for n, p in model.named_parameters():
        sq = p.grad.float().pow(2).sum()
        if ".experts." in n:
            expert_sq += sq
        else:
            dense_sq += sq
    dist.all_reduce(expert_sq, group=ep_group)
    total = (dense_sq + expert_sq).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in model.parameters():
        p.grad.mul_(coef)
    return total


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = min(1.0, (step - args.warmup) / max(1, args.max_steps - args.warmup))
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * t))


@torch.no_grad()
def evaluate(model, loader, args, device):
    model.eval()
    totals = torch.zeros(2, device=device)
    for i, (x, y) in enumerate(loader):
        if i >= args.eval_iters:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, _, _, _ = model(x)
        totals[0] += F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1), reduction="sum")
        totals[1] += y.numel()
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    assert world_size % args.ep_size == 0
    ep_group, edp_group = build_groups(world_size, args.ep_size)

    torch.manual_seed(args.seed)
    model = MoEGPT(args, ep_group).to(device)
    # different expert shards should not start identical
    with torch.no_grad():
        gen = torch.Generator(device=device).manual_seed(args.seed + 1000 + dist.get_rank(ep_group))
        for n, p in model.named_parameters():
            if ".experts." in n and p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.02)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=True)

    train_ds = TokenBlocks(args.train_bin, args.seq_len)
    val_ds = TokenBlocks(args.val_bin, args.seq_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=2, pin_memory=True)

    os.makedirs(args.out_dir, exist_ok=True)
    ckpt_path = os.path.join(args.out_dir, f"ckpt_rank{rank:03d}.pt")
    step, epoch = 0, 0
    if args.resume and os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, epoch = state["step"], state["epoch"]
        if rank == 0:
            print(f"resumed from step {step}")

    model.train()
    t0 = time.time()
    while step < args.max_steps:
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            if step >= args.max_steps:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, aux, z, dropped = model(x)
                ce = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
                loss = ce + args.aux_weight * aux + args.z_weight * z
            opt.zero_grad(set_to_none=True)
            loss.backward()
            sync_gradients(model, edp_group, world_size)
            clip_grad_norm_ep(model, 1.0, ep_group)
            opt.step()
            step += 1

            if step % args.log_every == 0:
                stats = torch.stack([ce.detach(), aux.detach(), dropped])
                dist.all_reduce(stats)
                stats /= world_size
                if rank == 0:
                    dt = (time.time() - t0) / args.log_every
                    t0 = time.time()
                    print(f"step {step} ce {stats[0]:.4f} aux {stats[1]:.4f} "
                          f"dropped {stats[2] * 100:.2f}% lr {lr_at(step, args):.2e} {dt * 1000:.0f}ms/it")

            if step % args.eval_every == 0:
                val_loss = evaluate(model, val_loader, args, device)
                if rank == 0:
                    print(f"step {step} val_loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}")

            if step % args.save_every == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "step": step, "epoch": epoch, "args": vars(args)}, ckpt_path)
        epoch += 1

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
