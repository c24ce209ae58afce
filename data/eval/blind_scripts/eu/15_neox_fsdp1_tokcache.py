#!/usr/bin/env python
"""GPT-NeoX-style LM trained from raw text with FSDP1.

The raw corpus (a directory of .txt/.md files) is tokenized once into a flat
uint16 .npy cache under --cache-dir (shared NFS) and memory-mapped afterwards.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        15_neox_fsdp1_tokcache.py --corpus /nfs/corpora/internal_docs_2024 --cache-dir /nfs/cache/tok
"""
import argparse
import functools
import glob
import hashlib
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoTokenizer


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--cache-dir", default="/nfs/cache/tok")
    ap.add_argument("--tokenizer", default="EleutherAI/gpt-neox-20b")
    ap.add_argument("--out", default="/nfs/ckpt/neox-1b-internal")
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--n-layer", type=int, default=16)
    ap.add_argument("--n-head", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--val-frac", type=float, default=0.005)
    return ap.parse_args()


def corpus_fingerprint(files, tokenizer_name):
    h = hashlib.sha1(tokenizer_name.encode())
    for fn in files:
        st = os.stat(fn)
        h.update(f"{fn}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def build_or_load_tokens(corpus_dir, cache_dir, tokenizer_name):
    files = sorted(glob.glob(os.path.join(corpus_dir, "**", "*.txt"), recursive=True)
                   + glob.glob(os.path.join(corpus_dir, "**", "*.md"), recursive=True))
    cache = os.path.join(cache_dir, f"tokens_{corpus_fingerprint(files, tokenizer_name)}.npy")
    if not os.path.exists(cache):
        tok = AutoTokenizer.from_pretrained(tokenizer_name)
        chunks = []
        for fn in files:
            with open(fn, encoding="utf-8", errors="ignore") as f:
                ids = tok(f.read())["input_ids"]
            chunks.append(np.asarray(ids + [tok.eos_token_id], dtype=np.uint16))
        os.makedirs(cache_dir, exist_ok=True)
        np.save(cache, np.concatenate(chunks))
    return np.load(cache, mmap_mode="r")


class Windows(Dataset):
    def __init__(self, tokens, ctx, start, end):
        self.t, self.ctx = tokens, ctx
        self.start = start
        self.n = (end - start - 1) // ctx

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = self.start + i * self.ctx
        x = torch.from_numpy(np.array(self.t[s:s + self.ctx + 1], dtype=np.int64))
        return x[:-1], x[1:]


class NeoXLayer(nn.Module):
    """Parallel attention + MLP residual, as in GPT-NeoX / GPT-J."""

    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln_attn = nn.LayerNorm(d)
        self.ln_mlp = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.dense = nn.Linear(d, d)
        self.fc_in = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        mlp = self.fc_out(F.gelu(self.fc_in(self.ln_mlp(x))))
        return x + self.dense(attn) + mlp


class NeoX(nn.Module):
    def __init__(self, vocab, d, n_layer, h, ctx):
        super().__init__()
        self.embed_in = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.layers = nn.ModuleList([NeoXLayer(d, h) for _ in range(n_layer)])
        self.final_ln = nn.LayerNorm(d)
        self.embed_out = nn.Linear(d, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, x):
        h = self.embed_in(x) + self.pos(torch.arange(x.size(1), device=x.device))
        for layer in self.layers:
            h = layer(h)
        return self.embed_out(self.final_ln(h))


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    tokens = build_or_load_tokens(args.corpus, args.cache_dir, args.tokenizer)
    n_val = int(len(tokens) * args.val_frac)
    train_ds = Windows(tokens, args.ctx, 0, len(tokens) - n_val)
    val_ds = Windows(tokens, args.ctx, len(tokens) - n_val, len(tokens))
    if rank == 0:
        print(f"{len(tokens) / 1e9:.2f}B tokens, {len(train_ds)} train windows, {len(val_ds)} val windows")

    torch.manual_seed(0)
    vocab = 50304
    model = NeoX(vocab, args.d_model, args.n_layer, args.n_head, args.ctx)
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={NeoXLayer}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        device_id=dev,
        sync_module_states=True,
        use_orig_params=True,
    )
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, NeoXLayer))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True,
                        drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.bs, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=2)
    total = args.epochs * len(loader)

    def lr_at(s):
        if s < args.warmup:
            return args.lr * (s + 1) / args.warmup
        return args.lr * 0.5 * (1 + math.cos(math.pi * (s - args.warmup) / max(1, total - args.warmup)))

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in loader:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            loss = F.cross_entropy(model(x).float().view(-1, vocab), y.view(-1))
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 25 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {l.item():.4f} lr {lr_at(step):.2e} "
                          f"{(time.time() - t0) / 25:.3f}s/it", flush=True)
                t0 = time.time()

        model.eval()
        agg = torch.zeros(2, device=dev)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(dev), y.to(dev)
                agg[0] += F.cross_entropy(model(x).float().view(-1, vocab), y.view(-1), reduction="sum")
                agg[1] += y.numel()
        dist.all_reduce(agg)
        if rank == 0:
            vl = (agg[0] / agg[1]).item()
            print(f"epoch {epoch} val_loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)

        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            dcp.save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)},
                     checkpoint_id=os.path.join(args.out, f"epoch_{epoch}"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
