"""Pretrain a Llama-style decoder with FSDP2 and per-block torch.compile.

Each transformer block is compiled on its own (regional compilation) so the
compile time does not grow with depth, then every block is sharded with
fully_shard. Checkpoints go through torch.distributed.checkpoint, every rank
writing its own shard into the same directory on the shared filesystem.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$HEAD_NODE:29500 fsdp2_regional_compile.py \
        --data /fsx/datasets/fineweb_tok --ckpt-dir /fsx/ckpt/llama1b
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--n-layers", type=int, default=16)
    p.add_argument("--n-heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--save-every", type=int, default=1000)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--no-compile", action="store_true")
    return p.parse_args()


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_cache(seq_len, head_dim, base=500000.0):
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    t = torch.arange(seq_len).float()
    freqs = torch.outer(t, inv)
    return torch.cos(freqs), torch.sin(freqs)


def apply_rope(x, cos, sin):
    x1, x2 = x[..., ::2], x[..., 1::2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.attn_norm = RMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = RMSNorm(dim)
        hidden = int(8 * dim / 3)
        hidden = 256 * ((hidden + 255) // 256)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).view(B, T, 3, self.n_heads, C // self.n_heads).unbind(2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, C))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args.dim, args.n_heads) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab, bias=False)
        cos, sin = rope_cache(args.seq_len, args.dim // args.n_heads)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        T = tokens.size(1)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


class PackedTokens(Dataset):
    """Fixed-length windows over one flat uint32 token file."""

    def __init__(self, path, seq_len):
        self.data = np.memmap(path, dtype=np.uint32, mode="r")
        self.seq_len = seq_len
        self.n = (len(self.data) - 1) // seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = i * self.seq_len
        chunk = torch.from_numpy(self.data[s : s + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.max_steps - args.warmup)
    return 0.1 * args.lr + 0.9 * args.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))
    torch.manual_seed(0)

    with torch.device("meta"):
        model = Transformer(args)

    if not args.no_compile:
        # compile block by block; the blocks are identical so Inductor reuses one graph
        for name, block in model.layers.named_children():
            model.layers.register_module(name, torch.compile(block))

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model.layers.values()):
        # the last block is resharded right away by the root's post-forward anyway
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < args.n_layers - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)

    model.to_empty(device="cuda")
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
        cos, sin = rope_cache(args.seq_len, args.dim // args.n_heads)
        model.rope_cos.copy_(cos)
        model.rope_sin.copy_(sin)

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    step = 0
    latest = os.path.join(args.ckpt_dir, "latest")
    if os.path.exists(os.path.join(latest, ".metadata")):
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd, "step": 0}
        dcp.load(state, checkpoint_id=latest)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = int(state["step"])
        if rank == 0:
            print(f"resumed from {latest} at step {step}", flush=True)

    ds = PackedTokens(os.path.join(args.data, "train.bin"), args.seq_len)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=1234, drop_last=True)
    loader = DataLoader(ds, batch_size=args.micro_batch, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    epoch = step // len(loader)
    sampler.set_epoch(epoch)
    it = iter(loader)
    for _ in range(step % len(loader)):
        next(it)

    model.train()
    tokens_seen = 0
    t0 = time.perf_counter()
    while step < args.max_steps:
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            it = iter(loader)
            x, y = next(it)
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)

        for g in optim.param_groups:
            g["lr"] = lr_at(step, args)
        logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += x.numel()

        if step % args.log_every == 0:
            stats = torch.stack([loss.detach(), torch.tensor(float(tokens_seen), device="cuda")])
            dist.all_reduce(stats)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if rank == 0:
                print(
                    f"step {step} loss {stats[0].item() / world:.4f} gnorm {gnorm.full_tensor().item():.3f} "
                    f"lr {lr_at(step, args):.2e} tok/s {stats[1].item() / dt:,.0f}",
                    flush=True,
                )
            tokens_seen = 0
            t0 = time.perf_counter()

        if step % args.save_every == 0 or step == args.max_steps:
            model_sd, optim_sd = get_state_dict(model, optim)
            ckpt_path = os.path.join(args.ckpt_dir, f"step_{step:07d}")
            dcp.save({"model": model_sd, "optim": optim_sd, "step": step}, checkpoint_id=ckpt_path)
            dist.barrier()
            if rank == 0:
                if os.path.islink(latest):
                    os.unlink(latest)
                os.symlink(os.path.basename(ckpt_path), latest)

    # one consolidated bf16 copy of the weights for evaluation / export
    full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({k: v.to(torch.bfloat16) for k, v in full_sd.items()}, os.path.join(args.ckpt_dir, "final_weights.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
