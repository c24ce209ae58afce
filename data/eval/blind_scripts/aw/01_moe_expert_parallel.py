#!/usr/bin/env python
"""Expert-parallel MoE language model pretraining.

Each rank owns num_experts / world_size experts. Tokens are routed with top-1
(switch) gating, dropped above the expert capacity, and exchanged between ranks
with all_to_all_single. Dense parameters are replicated on every rank and their
gradients are averaged by hand after backward.

    torchrun --nproc_per_node=8 01_moe_expert_parallel.py --data /data/owt/train.bin
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


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--val-data", default=None)
    p.add_argument("--out-dir", default="checkpoints/moe_ep")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--n-layers", type=int, default=12)
    p.add_argument("--n-heads", type=int, default=12)
    p.add_argument("--d-ff", type=int, default=3072)
    p.add_argument("--num-experts", type=int, default=16)
    p.add_argument("--moe-every", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--aux-coef", type=float, default=0.01)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--max-steps", type=int, default=100000)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--eval-batches", type=int, default=50)
    p.add_argument("--save-every", type=int, default=5000)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


class TokenDataset(Dataset):
    def __init__(self, path, seq_len):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len
        self.n = (len(self.tokens) - 1) // seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        start = i * self.seq_len
        chunk = torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, x, output_splits, input_splits):
        ctx.group = group
        ctx.output_splits = output_splits
        ctx.input_splits = input_splits
        x = x.contiguous()
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, output_split_sizes=output_splits,
                               input_split_sizes=input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad_in = _AllToAll.apply(ctx.group, grad, ctx.input_splits, ctx.output_splits)
        return None, grad_in, None, None


class ExpertFFN(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class SwitchMoE(nn.Module):
    def __init__(self, d_model, d_ff, num_experts, capacity_factor, group=None):
        super().__init__()
        self.group = group
        self.ep_size = dist.get_world_size(group)
        assert num_experts % self.ep_size == 0, "num_experts must be divisible by world size"
        self.num_experts = num_experts
        self.num_local = num_experts // self.ep_size
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleList([ExpertFFN(d_model, d_ff) for _ in range(self.num_local)])
        for p in self.experts.parameters():
            p.expert = True
        self.aux_loss = None

    def forward(self, x):
        B, T, D = x.shape
        tokens = x.reshape(-1, D)
        n_tokens = tokens.size(0)

        probs = F.softmax(self.router(tokens).float(), dim=-1)
        gate, expert_idx = probs.max(dim=-1)

        # switch-transformer load balancing loss
        density = F.one_hot(expert_idx, self.num_experts).float().mean(0)
        self.aux_loss = self.num_experts * (density * probs.mean(0)).sum()

        capacity = int(math.ceil(self.capacity_factor * n_tokens / self.num_experts))
        one_hot = F.one_hot(expert_idx, self.num_experts)
        position = ((one_hot.cumsum(0) - 1) * one_hot).sum(-1)
        kept = (position < capacity).nonzero(as_tuple=True)[0]

        order = torch.argsort(expert_idx[kept], stable=True)
        kept = kept[order]
        sorted_experts = expert_idx[kept]
        dispatched = tokens[kept]

        # split sizes must be python ints, so do the bookkeeping on the host
        tokens_per_expert = torch.bincount(sorted_experts, minlength=self.num_experts).cpu()
        recv_per_expert = torch.empty_like(tokens_per_expert)
        dist.all_to_all_single(recv_per_expert, tokens_per_expert, group=self.group)

        input_splits = tokens_per_expert.view(self.ep_size, self.num_local).sum(1).tolist()
        output_splits = recv_per_expert.view(self.ep_size, self.num_local).sum(1).tolist()
        received = _AllToAll.apply(self.group, dispatched, output_splits, input_splits)

        # received is laid out [src_rank][local_expert]; regroup per local expert
        chunk_sizes = recv_per_expert.tolist()
        chunks = list(received.split(chunk_sizes))
        for j, expert in enumerate(self.experts):
            ids = [r * self.num_local + j for r in range(self.ep_size)]
            inp = torch.cat([chunks[i] for i in ids])
            out = expert(inp)
            for i, o in zip(ids, out.split([chunk_sizes[i] for i in ids])):
                chunks[i] = o
        expert_out = torch.cat(chunks)

        combined = _AllToAll.apply(self.group, expert_out, input_splits, output_splits)
        combined = combined.to(tokens.dtype) * gate[kept].unsqueeze(1).to(tokens.dtype)
        out = tokens.new_zeros(tokens.shape).index_add(0, kept, combined)
        return out.view(B, T, D)


class Block(nn.Module):
    def __init__(self, args, use_moe):
        super().__init__()
        self.ln1 = nn.LayerNorm(args.d_model)
        self.ln2 = nn.LayerNorm(args.d_model)
        self.n_heads = args.n_heads
        self.qkv = nn.Linear(args.d_model, 3 * args.d_model)
        self.proj = nn.Linear(args.d_model, args.d_model)
        if use_moe:
            self.mlp = SwitchMoE(args.d_model, args.d_ff, args.num_experts, args.capacity_factor)
        else:
            self.mlp = ExpertFFN(args.d_model, args.d_ff)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.ln2(x))


class MoEGPT(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.wte = nn.Embedding(args.vocab_size, args.d_model)
        self.wpe = nn.Embedding(args.seq_len, args.d_model)
        self.blocks = nn.ModuleList(
            [Block(args, use_moe=(i % args.moe_every == 1)) for i in range(args.n_layers)])
        self.ln_f = nn.LayerNorm(args.d_model)
        self.head = nn.Linear(args.d_model, args.vocab_size, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))

    def aux_loss(self):
        losses = [m.aux_loss for m in self.modules() if isinstance(m, SwitchMoE)]
        return torch.stack(losses).mean()


def sync_dense_params(model):
    for p in model.parameters():
        if not getattr(p, "expert", False):
            dist.broadcast(p.data, src=0)


def allreduce_grads(model, world_size):
    dense = [p.grad for p in model.parameters()
             if p.grad is not None and not getattr(p, "expert", False)]
    flat = _flatten_dense_tensors(dense)
    dist.all_reduce(flat)
    flat.div_(world_size)
    for g, synced in zip(dense, _unflatten_dense_tensors(flat, dense)):
        g.copy_(synced)
    # expert grads already hold contributions from every rank's tokens
    for p in model.parameters():
        if getattr(p, "expert", False) and p.grad is not None:
            p.grad.div_(world_size)


@torch.no_grad()
def evaluate(model, loader, device, max_batches):
    model.eval()
    total = torch.zeros(2, device=device)
    for i, (x, y) in enumerate(loader):
        if i >= max_batches:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        total += torch.tensor([loss.item() * x.size(0), x.size(0)], device=device)
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def save_checkpoint(model, optimizer, step, args, rank):
    os.makedirs(args.out_dir, exist_ok=True)
    expert_state = {k: v for k, v in model.state_dict().items() if ".experts." in k}
    torch.save({"experts": expert_state, "step": step},
               os.path.join(args.out_dir, f"experts_step{step}_rank{rank:03d}.pt"))
    if rank == 0:
        dense_state = {k: v for k, v in model.state_dict().items() if ".experts." not in k}
        torch.save({"dense": dense_state, "step": step, "args": vars(args)},
                   os.path.join(args.out_dir, f"dense_step{step}.pt"))
    dist.barrier()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    torch.manual_seed(args.seed + rank)
    model = MoEGPT(args).to(device)
    sync_dense_params(model)

    train_ds = TokenDataset(args.data, args.seq_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                        num_workers=4, pin_memory=True, drop_last=True)
    val_loader = None
    if args.val_data:
        val_ds = TokenDataset(args.val_data, args.seq_len)
        val_loader = DataLoader(val_ds, batch_size=args.batch_size,
                                sampler=DistributedSampler(val_ds, shuffle=False),
                                num_workers=2, pin_memory=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))

    def lr_lambda(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.max_steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    step, epoch = 0, 0
    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            ce = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
            loss = ce + args.aux_coef * model.aux_loss()

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            allreduce_grads(model, world_size)
            optimizer.step()
            scheduler.step()
            step += 1

            if step % args.log_every == 0 and rank == 0:
                dt = (time.time() - t0) / args.log_every
                print(f"step {step} | ce {ce.item():.4f} | aux {model.aux_loss().item():.4f} "
                      f"| lr {scheduler.get_last_lr()[0]:.2e} | {dt * 1000:.0f} ms/it", flush=True)
                t0 = time.time()
            if val_loader is not None and step % args.eval_every == 0:
                val_loss = evaluate(model, val_loader, device, args.eval_batches)
                if rank == 0:
                    print(f"step {step} | val loss {val_loss:.4f} | ppl {math.exp(val_loss):.2f}", flush=True)
            if step % args.save_every == 0:
                save_checkpoint(model, optimizer, step, args, rank)
            if step >= args.max_steps:
                break
        epoch += 1

    save_checkpoint(model, optimizer, step, args, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
