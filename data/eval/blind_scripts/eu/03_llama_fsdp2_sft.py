"""Supervised fine-tuning of a hand-rolled Llama-architecture model with FSDP2.

Data is a packed, pre-tokenized HF dataset saved with `save_to_disk` that has
`input_ids` and `labels` columns (labels are -100 on prompt tokens).
Initial weights come from a DCP checkpoint produced by the pretraining job.
"""
import argparse
import json
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_from_disk
from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.utils.data import DataLoader, DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--init-ckpt", required=True, help="DCP directory with a 'model' entry")
    p.add_argument("--data", default="/shared/sft/packed_4k")
    p.add_argument("--output-root", default="/shared/sft/runs")
    p.add_argument("--run-prefix", default="llama-sft")
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--n-layers", type=int, default=32)
    p.add_argument("--n-heads", type=int, default=32)
    p.add_argument("--n-kv-heads", type=int, default=8)
    p.add_argument("--ffn-dim", type=int, default=14336)
    p.add_argument("--vocab-size", type=int, default=128256)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--warmup-ratio", type=float, default=0.03)
    p.add_argument("--save-every", type=int, default=500)
    return p.parse_args()


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight


def rope(x, cos, sin):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.n_heads, self.n_kv = a.n_heads, a.n_kv_heads
        self.hd = a.dim // a.n_heads
        self.wq = nn.Linear(a.dim, a.n_heads * self.hd, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(a.n_heads * self.hd, a.dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.hd).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class DecoderLayer(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.attn_norm = RMSNorm(a.dim)
        self.attn = Attention(a)
        self.ffn_norm = RMSNorm(a.dim)
        self.w1 = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.w2 = nn.Linear(a.ffn_dim, a.dim, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.hd = a.dim // a.n_heads
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList([DecoderLayer(a) for _ in range(a.n_layers)])
        self.norm = RMSNorm(a.dim)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)

    def rotary(self, T, device, base=500000.0):
        inv = 1.0 / (base ** (torch.arange(0, self.hd, 2, device=device).float() / self.hd))
        freqs = torch.outer(torch.arange(T, device=device).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)

    def forward(self, tokens):
        cos, sin = self.rotary(tokens.size(1), tokens.device)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def init_distributed():
    dist.init_process_group(backend="nccl", timeout=timedelta(minutes=30))
    return dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])


def shared_run_dir(root, prefix, rank):
    # rank 0 picks the timestamp so every rank writes into the same run directory
    stamp = torch.tensor([int(time.time()) if rank == 0 else 0], dtype=torch.int64, device="cuda")
    dist.broadcast(stamp, src=0)
    return os.path.join(root, f"{prefix}-{stamp.item()}")


def collate(batch):
    ids = torch.tensor([b["input_ids"] for b in batch], dtype=torch.long)
    labels = torch.tensor([b["labels"] for b in batch], dtype=torch.long)
    return ids, labels


def main():
    args = get_args()
    rank, world, local_rank = init_distributed()
    run_dir = shared_run_dir(args.output_root, args.run_prefix, rank)
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    with torch.device("meta"):
        model = Llama(args)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer)
        # the last layer is all-gathered again right away for backward, so keep it unsharded
        fully_shard(model.layers[i], mp_policy=mp, reshard_after_forward=(i < len(model.layers) - 1))
    fully_shard(model, mp_policy=mp)
    model.to_empty(device=device)

    # pretrained weights: DCP reshards them onto this job's layout
    sd = get_model_state_dict(model)
    dcp.load({"model": sd}, checkpoint_id=args.init_ckpt)
    set_model_state_dict(model, sd, options=StateDictOptions(strict=True))

    ds = load_from_disk(args.data)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=42)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=4, pin_memory=True, drop_last=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total_steps = args.epochs * len(loader)
    warmup = int(args.warmup_ratio * total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (s + 1) / max(1, warmup) if s < warmup
        else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total_steps - warmup))),
    )
    if rank == 0:
        print(f"run_dir={run_dir} world={world} steps={total_steps}")

    step = 0
    model.train()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for ids, labels in loader:
            ids, labels = ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                avg = loss.detach()
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total_steps} loss {avg.item():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e}")

            if step % args.save_every == 0:
                model_sd, optim_sd = get_state_dict(model, optimizer)
                dcp.save({"model": model_sd, "optim": optim_sd},
                         checkpoint_id=os.path.join(run_dir, f"step_{step}"))

    # final weights only, for eval / conversion
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=os.path.join(run_dir, "final"))
    if rank == 0:
        print("done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
