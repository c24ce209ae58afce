"""2D parallel Llama pretraining: tensor parallel inside a node, FSDP across nodes.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        09_fsdp_tp_2d_llama.py --data /lustre/datasets/fineweb_tok --tp 8
"""
import argparse
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--ckpt-dir", default="/lustre/ckpt/llama_2d")
    p.add_argument("--resume-from", default=None)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--n-layers", type=int, default=32)
    p.add_argument("--n-heads", type=int, default=32)
    p.add_argument("--ffn-dim", type=int, default=11008)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--local-batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--steps", type=int, default=60000)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--ckpt-every", type=int, default=2000)
    return p.parse_args()


class ShardedTokens(Dataset):
    def __init__(self, root, seq_len, split="train"):
        files = sorted(glob.glob(os.path.join(root, f"{split}_*.npy")))
        self.arrays = [np.load(f, mmap_mode="r") for f in files]
        self.seq_len = seq_len
        self.index = [(a, i) for a, arr in enumerate(self.arrays) for i in range((len(arr) - 1) // seq_len)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k):
        a, i = self.index[k]
        s = i * self.seq_len
        return torch.from_numpy(self.arrays[a][s:s + self.seq_len + 1].astype(np.int64))


def rope_cache(seq_len, head_dim, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(seq_len).float(), inv)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rope(x, freqs):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs[None, :, None, :]).flatten(3)
    return out.type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


class Attention(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.head_dim = a.dim // a.n_heads
        self.wq = nn.Linear(a.dim, a.dim, bias=False)
        self.wk = nn.Linear(a.dim, a.dim, bias=False)
        self.wv = nn.Linear(a.dim, a.dim, bias=False)
        self.wo = nn.Linear(a.dim, a.dim, bias=False)

    def forward(self, x, freqs):
        B, T, _ = x.shape
        # -1 heads: under TP each rank only has n_heads / tp of them
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.w2 = nn.Linear(a.ffn_dim, a.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(a.dim), RMSNorm(a.dim)
        self.attention, self.feed_forward = Attention(a), FeedForward(a)

    def forward(self, x, freqs):
        x = x + self.attention(self.attention_norm(x), freqs)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok_embeddings = nn.Embedding(a.vocab, a.dim)
        self.layers = nn.ModuleList([Block(a) for _ in range(a.n_layers)])
        self.norm = RMSNorm(a.dim)
        self.output = nn.Linear(a.dim, a.vocab, bias=False)
        self.register_buffer("freqs", rope_cache(a.seq_len, a.dim // a.n_heads), persistent=False)

    def forward(self, ids):
        x = self.tok_embeddings(ids)
        f = self.freqs[: ids.size(1)]
        for layer in self.layers:
            x = layer(x, f)
        return self.output(self.norm(x))


def build_parallel_model(a, mesh):
    model = Llama(a)
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        })
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    return model


def main():
    a = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    mesh = init_device_mesh("cuda", (world // a.tp, a.tp), mesh_dim_names=("dp", "tp"))
    rank = dist.get_rank()
    dp_mesh = mesh["dp"]
    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()

    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_parallel_model(a, mesh)
    model.to_empty(device="cuda")
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=1.0)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)
    model.freqs = rope_cache(a.seq_len, a.dim // a.n_heads).cuda()

    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / a.warmup if s < a.warmup else 0.1 + 0.45 * (1 + math.cos(math.pi * (s - a.warmup) / (a.steps - a.warmup))))

    start = 0
    if a.resume_from:
        full = torch.load(os.path.join(a.resume_from, "model.pt"), map_location="cpu", mmap=True)
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
        start = torch.load(os.path.join(a.resume_from, "meta.pt"), map_location="cpu")["step"]
        for _ in range(start):
            sched.step()

    train_ds = ShardedTokens(a.data, a.seq_len, "train")
    val_ds = ShardedTokens(a.data, a.seq_len, "val")
    sampler = DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=1)
    loader = DataLoader(train_ds, a.local_batch, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, a.local_batch, num_workers=2, drop_last=True,
                            sampler=DistributedSampler(val_ds, num_replicas=dp_size, rank=dp_rank, shuffle=False))

    step, epoch = start, 0
    t0 = time.time()
    while step < a.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = batch.cuda(non_blocking=True)
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            if hasattr(gnorm, "full_tensor"):
                gnorm = gnorm.full_tensor()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1

            if step % 10 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG, group=dp_mesh.get_group())
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} gnorm {gnorm.item():.3f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 10:.2f}s/it", flush=True)
                    t0 = time.time()

            if step % a.eval_every == 0:
                model.eval()
                tot = torch.zeros(2, device="cuda")
                with torch.no_grad():
                    for i, vb in enumerate(val_loader):
                        if i == 50:
                            break
                        vb = vb.cuda(non_blocking=True)
                        tot[0] += F.cross_entropy(model(vb[:, :-1]).float().flatten(0, 1), vb[:, 1:].flatten())
                        tot[1] += 1
                dist.all_reduce(tot, group=dp_mesh.get_group())
                model.train()
                if rank == 0:
                    print(f"step {step} val_loss {(tot[0] / tot[1]).item():.4f}", flush=True)

            if step % a.ckpt_every == 0:
                out = os.path.join(a.ckpt_dir, f"step_{step}")
                if rank == 0:
                    os.makedirs(out, exist_ok=True)
                    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
                    torch.save(sd, os.path.join(out, "model.pt"))
                    torch.save({"step": step}, os.path.join(out, "meta.pt"))
                dist.barrier()
            if step >= a.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
