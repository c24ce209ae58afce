"""Tensor parallel x data parallel GPT pretraining, Megatron-LM style groups.

Ranks [k*tp, (k+1)*tp) form one tensor-parallel group (one node); ranks with
the same TP index across nodes form a data-parallel group wrapped by DDP.

    # on each of 2 nodes
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=$NODE_RANK \
        --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        05_megatron_style_tp_dp.py --dataset /shared/tokenized/pile_2048 --tp 8
"""
import argparse
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--save", default="/shared/ckpt/gpt_tp")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--ffn", type=int, default=10240)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1.6e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--train-steps", type=int, default=200000)
    ap.add_argument("--save-interval", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=-1, help="-1: pick one at random on rank 0")
    return ap.parse_args()


def initialize_model_parallel(tp_size):
    world, rank = dist.get_world_size(), dist.get_rank()
    assert world % tp_size == 0
    tp_group = dp_group = None
    for i in range(world // tp_size):
        ranks = list(range(i * tp_size, (i + 1) * tp_size))
        g = dist.new_group(ranks)
        if rank in ranks:
            tp_group = g
    for j in range(tp_size):
        ranks = list(range(j, world, tp_size))
        g = dist.new_group(ranks)
        if rank in ranks:
            dp_group = g
    return tp_group, dp_group


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class ColumnLinear(nn.Module):
    def __init__(self, i, o, group):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(o // dist.get_world_size(group), i))
        self.bias = nn.Parameter(torch.zeros(o // dist.get_world_size(group)))
        self.init_std = 0.02
        nn.init.normal_(self.weight, std=self.init_std)
        self.weight.tp_sharded = self.bias.tp_sharded = True

    def forward(self, x):
        return F.linear(_Copy.apply(x, self.group), self.weight, self.bias)


class RowLinear(nn.Module):
    def __init__(self, i, o, group, n_layers):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(o, i // dist.get_world_size(group)))
        self.bias = nn.Parameter(torch.zeros(o))
        self.init_std = 0.02 / math.sqrt(2 * n_layers)
        nn.init.normal_(self.weight, std=self.init_std)
        self.weight.tp_sharded = True

    def forward(self, x):
        return _Reduce.apply(F.linear(x, self.weight), self.group) + self.bias


class Layer(nn.Module):
    def __init__(self, a, group):
        super().__init__()
        tp = dist.get_world_size(group)
        self.heads = a.heads // tp
        self.hd = a.hidden // a.heads
        self.ln1, self.ln2 = nn.LayerNorm(a.hidden), nn.LayerNorm(a.hidden)
        self.qkv = ColumnLinear(a.hidden, 3 * a.hidden, group)
        self.dense = RowLinear(a.hidden, a.hidden, group, a.layers)
        self.fc_in = ColumnLinear(a.hidden, a.ffn, group)
        self.fc_out = RowLinear(a.ffn, a.hidden, group, a.layers)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, self.heads, 3 * self.hd).transpose(1, 2).chunk(3, -1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + self.dense(y)
        return x + self.fc_out(F.gelu(self.fc_in(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, a, group):
        super().__init__()
        self.wte = nn.Embedding(a.vocab, a.hidden)
        self.wpe = nn.Embedding(a.seq_len, a.hidden)
        self.layers = nn.ModuleList([Layer(a, group) for _ in range(a.layers)])
        self.ln_f = nn.LayerNorm(a.hidden)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.size(1), device=ids.device))
        for layer in self.layers:
            x = layer(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def clip_grads(model, max_norm, tp_group):
    sharded = torch.zeros((), device="cuda")
    replicated = torch.zeros((), device="cuda")
    for p in model.parameters():
        if p.grad is None:
            continue
        if getattr(p, "tp_sharded", False):
            sharded += p.grad.float().norm() ** 2
        else:
            replicated += p.grad.float().norm() ** 2
    dist.all_reduce(sharded, group=tp_group)
    norm = (sharded + replicated).sqrt()
    torch._foreach_mul_([p.grad for p in model.parameters() if p.grad is not None],
                        torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp_group, dp_group = initialize_model_parallel(args.tp)
    tp_rank, dp_rank = rank % args.tp, rank // args.tp
    dp_size = world // args.tp

    # all ranks must agree on the base seed
    seed = torch.tensor([args.seed if args.seed >= 0 else random.randint(0, 2 ** 31 - 1)], device="cuda")
    dist.broadcast(seed, src=0)
    seed = int(seed.item())

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    # replicated weights get the same seed everywhere, TP shards a per-shard one
    torch.manual_seed(seed)
    model = GPT(args, tp_group)
    torch.manual_seed(seed + 1000 * (tp_rank + 1))
    for m in model.modules():
        if isinstance(m, (ColumnLinear, RowLinear)):
            nn.init.normal_(m.weight, std=m.init_std)
    model = DDP(model.to(device), device_ids=[local_rank], process_group=dp_group)

    ds = load_from_disk(args.dataset).with_format("torch", columns=["input_ids"])
    sampler = DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=seed)
    loader = DataLoader(ds, batch_size=args.micro_batch, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup,
                           0.5 * (1 + math.cos(math.pi * min(1.0, s / args.train_steps)))))

    step, epoch = 0, 0
    t0 = time.time()
    while step < args.train_steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            ids = batch["input_ids"].to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = clip_grads(model, 1.0, tp_group)
            opt.step()
            sched.step()
            step += 1

            if step % 20 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, group=dp_group)
                if rank == 0:
                    print(f"step {step} loss {l.item() / dp_size:.4f} gnorm {gnorm.item():.3f} "
                          f"{(time.time() - t0) / 20:.2f}s/it", flush=True)
                    t0 = time.time()
            if step % args.save_interval == 0:
                if dp_rank == 0:
                    path = os.path.join(args.save, f"iter_{step:07d}", f"mp_rank_{tp_rank:02d}")
                    os.makedirs(path, exist_ok=True)
                    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                                "scheduler": sched.state_dict(), "step": step, "seed": seed,
                                "tp": args.tp}, os.path.join(path, "model_optim_rng.pt"))
                dist.barrier()
            if step >= args.train_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
