"""BERT-large masked-LM pretraining with tensor-parallel layers (Megatron style).

    torchrun --nproc_per_node=8 11_tp_bert_mlm.py --tensor-parallel 2 --data data/wiki_bert_512.npy
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

CLS, SEP, PAD, MASK = 101, 102, 0, 103
tp_group = dp_group = None
tp_rank = tp_size = dp_rank = dp_size = None


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--tensor-parallel", type=int, default=2)
    p.add_argument("--data", required=True)
    p.add_argument("--vocab", type=int, default=30528)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=32, help="per data-parallel rank")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--steps", type=int, default=200000)
    p.add_argument("--warmup", type=int, default=10000)
    p.add_argument("--mask-prob", type=float, default=0.15)
    p.add_argument("--save-dir", default="ckpt/bert_tp")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def build_groups(tp):
    global tp_group, dp_group, tp_rank, tp_size, dp_rank, dp_size
    world, rank = dist.get_world_size(), dist.get_rank()
    tp_size, dp_size = tp, world // tp
    tp_rank, dp_rank = rank % tp, rank // tp
    for i in range(dp_size):
        g = dist.new_group(list(range(i * tp, (i + 1) * tp)))
        if i == dp_rank:
            tp_group = g
    for j in range(tp):
        g = dist.new_group(list(range(j, world, tp)))
        if j == tp_rank:
            dp_group = g


class f_copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=tp_group)
        return g


class g_reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = x.clone()
        dist.all_reduce(out, group=tp_group)
        return out

    @staticmethod
    def backward(ctx, g):
        return g


def shard_of(full, dim):
    return nn.Parameter(full.tensor_split(tp_size, dim=dim)[tp_rank].clone())


class ColLinear(nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.weight = shard_of(torch.randn(o, i) * 0.02, 0)
        self.bias = shard_of(torch.zeros(o), 0)

    def forward(self, x):
        return F.linear(f_copy.apply(x), self.weight, self.bias)


class RowLinear(nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.weight = shard_of(torch.randn(o, i) * 0.02, 1)
        self.bias = nn.Parameter(torch.zeros(o))

    def forward(self, x):
        return g_reduce.apply(F.linear(x, self.weight)) + self.bias


class BertLayer(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.nh, self.hd = heads // tp_size, h // heads
        self.qkv, self.attn_out = ColLinear(h, 3 * h), RowLinear(h, h)
        self.inter, self.out = ColLinear(h, 4 * h), RowLinear(4 * h, h)
        self.ln1, self.ln2 = nn.LayerNorm(h, eps=1e-12), nn.LayerNorm(h, eps=1e-12)

    def forward(self, x, keep):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.nh, self.hd).permute(2, 0, 3, 1, 4)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        x = self.ln1(x + self.attn_out(ctx.transpose(1, 2).reshape(B, T, -1)))
        return self.ln2(x + self.out(F.gelu(self.inter(x))))


class BertMLM(nn.Module):
    def __init__(self, vocab, h, heads, layers, seq):
        super().__init__()
        self.part = vocab // tp_size
        self.lo = tp_rank * self.part
        self.word = shard_of(torch.randn(vocab, h) * 0.02, 0)
        self.pos = nn.Embedding(seq, h)
        self.emb_ln = nn.LayerNorm(h, eps=1e-12)
        self.layers = nn.ModuleList(BertLayer(h, heads) for _ in range(layers))
        self.transform = nn.Linear(h, h)
        self.transform_ln = nn.LayerNorm(h, eps=1e-12)
        self.out_bias = shard_of(torch.zeros(vocab), 0)

    def forward(self, ids, labels):
        outside = (ids < self.lo) | (ids >= self.lo + self.part)
        e = F.embedding((ids - self.lo).masked_fill(outside, 0), self.word).masked_fill(outside[..., None], 0)
        x = self.emb_ln(g_reduce.apply(e) + self.pos(torch.arange(ids.size(1), device=ids.device)))
        keep = ids != PAD
        for layer in self.layers:
            x = layer(x, keep)
        sel = labels != -100
        h = self.transform_ln(F.gelu(self.transform(x[sel])))
        logits = F.linear(f_copy.apply(h), self.word, self.out_bias)  # (N, vocab/tp)
        return parallel_cross_entropy(logits.float(), labels[sel], self.lo, self.lo + self.part)


def parallel_cross_entropy(logits, target, lo, hi):
    # max / sum-exp / target-logit are reduced over the TP group; autograd handles the rest
    with torch.no_grad():
        gmax = logits.max(-1, keepdim=True)[0]
        dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - gmax
    sum_exp = g_reduce.apply(shifted.exp().sum(-1))
    inside = (target >= lo) & (target < hi)
    local_t = (target - lo).clamp(0, logits.size(-1) - 1)
    tgt = shifted.gather(1, local_t[:, None]).squeeze(1) * inside
    tgt = g_reduce.apply(tgt)
    return (sum_exp.log() - tgt).mean()


class MLMData(Dataset):
    def __init__(self, path):
        self.x = np.load(path, mmap_mode="r")  # (N, seq) token ids, already padded

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return torch.from_numpy(np.array(self.x[i], dtype=np.int64))


def mask_tokens(ids, prob, vocab, gen):
    labels = ids.clone()
    special = (ids == PAD) | (ids == CLS) | (ids == SEP)
    p = torch.full(ids.shape, prob, device=ids.device).masked_fill(special, 0.0)
    chosen = torch.bernoulli(p, generator=gen).bool()
    labels[~chosen] = -100
    r = torch.rand(ids.shape, device=ids.device, generator=gen)
    ids = ids.clone()
    ids[chosen & (r < 0.8)] = MASK
    rnd = chosen & (r >= 0.8) & (r < 0.9)
    ids[rnd] = torch.randint(1000, vocab, (int(rnd.sum()),), device=ids.device, generator=gen)
    return ids, labels


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group("nccl")
    build_groups(args.tensor_parallel)
    torch.manual_seed(args.seed)

    model = BertMLM(args.vocab, args.hidden, args.heads, args.layers, args.seq).cuda()
    model = DDP(model, device_ids=[args.local_rank], process_group=dp_group)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.999), eps=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, s / args.warmup) * max(0.0, (args.steps - s) / (args.steps - args.warmup)))

    ds = MLMData(args.data)
    sampler = DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=args.seed)
    dl = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    # masking runs on the GPU; same generator state on all TP peers of one replica
    gen = torch.Generator(device="cuda")
    gen.manual_seed(args.seed * 1000 + dp_rank)

    step, epoch, t0 = 0, 0, time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for ids in dl:
            ids, labels = mask_tokens(ids.cuda(non_blocking=True), args.mask_prob, args.vocab, gen)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(ids, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, group=dp_group)
                if dist.get_rank() == 0:
                    print(f"step {step} mlm_loss {l.item() / dp_size:.4f} "
                          f"({(time.time() - t0) / 50:.3f}s/step)", flush=True)
                    t0 = time.time()
            if step % 5000 == 0 and dp_rank == 0:
                os.makedirs(args.save_dir, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                           os.path.join(args.save_dir, f"step{step}-tp{tp_rank}.pt"))
            if step >= args.steps:
                break
        epoch += 1

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
