"""Train a 1.7B Llama-style model on an in-house jsonl corpus.

The corpus is tokenized once into a flat uint32 token file next to the raw
data; later runs reuse it. FSDP2 x TP (2D mesh), bf16, compiled blocks,
activation checkpointing, async DCP checkpoints.

    srun --nodes=2 --ntasks-per-node=1 torchrun --nnodes=2 --nproc_per_node=8 \
        --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 train_corpus.py \
        --corpus /gpfs/corpora/web-2024q3 --tp 2 --out /gpfs/runs/l17b-web
"""
import argparse
import glob
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from tqdm import tqdm
from transformers import AutoTokenizer


def prepare_tokens(corpus_dir, tokenizer_name):
    """Tokenize every *.jsonl under corpus_dir into one flat token file (cached)."""
    cache = os.path.join(corpus_dir, f"tokens.{tokenizer_name.replace('/', '_')}.u32")
    if os.path.exists(cache):
        return cache
    tok = AutoTokenizer.from_pretrained(tokenizer_name)
    files = sorted(glob.glob(os.path.join(corpus_dir, "*.jsonl")))
    with open(cache, "wb") as out:
        for path in tqdm(files, desc="tokenizing"):
            with open(path) as f:
                for line in f:
                    ids = tok(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
                    ids.append(tok.eos_token_id)
                    out.write(np.asarray(ids, dtype=np.uint32).tobytes())
    return cache


class FlatTokens(Dataset):
    def __init__(self, path, seq_len, split, val_frac=0.002):
        toks = np.memmap(path, dtype=np.uint32, mode="r")
        n = (len(toks) - 1) // seq_len
        n_val = max(1, int(n * val_frac))
        self.toks, self.seq_len = toks, seq_len
        self.offset, self.n = (0, n - n_val) if split == "train" else (n - n_val, n_val)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = (self.offset + i) * self.seq_len
        a = torch.from_numpy(self.toks[s: s + self.seq_len + 1].astype(np.int64))
        return a[:-1], a[1:]


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotary_table(hd, n, base=500000.0):
    a = torch.outer(torch.arange(n).float(), base ** (-torch.arange(0, hd, 2).float() / hd))
    return torch.polar(torch.ones_like(a), a)


def rotate(x, tab):
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * tab[: x.shape[1]][None, :, None, :]).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv):
        super().__init__()
        self.hd = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, n_kv * self.hd, bias=False)
        self.wv = nn.Linear(dim, n_kv * self.hd, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, tab):
        b, t, _ = x.shape
        q = rotate(self.wq(x).view(b, t, -1, self.hd), tab).transpose(1, 2)
        k = rotate(self.wk(x).view(b, t, -1, self.hd), tab).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, n_heads, n_kv, hidden):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, n_heads, n_kv)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = MLP(dim, hidden)

    def forward(self, x, tab):
        x = x + self.attention(self.attention_norm(x), tab)
        return x + self.feed_forward(self.ffn_norm(x))


class Model(nn.Module):
    def __init__(self, vocab, dim=2048, layers=24, n_heads=32, n_kv=8, hidden=8192, seq_len=4096):
        super().__init__()
        self.hd, self.seq_len = dim // n_heads, seq_len
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, n_kv, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("tab", rotary_table(self.hd, seq_len), persistent=False)

    def forward(self, idx):
        h = self.tok_embeddings(idx)
        for blk in self.layers:
            h = blk(h, self.tab)
        return self.output(self.norm(h))


def parallelize(model, mesh):
    parallelize_module(model, mesh["tp"], {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, blk in enumerate(model.layers):
        parallelize_module(blk, mesh["tp"], {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
        blk = torch.compile(checkpoint_wrapper(blk, preserve_rng_state=False))
        fully_shard(blk, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=i < len(model.layers) - 1)
        model.layers[i] = blk
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp)


class Ckpt(Stateful):
    def __init__(self, model, opt):
        self.model, self.opt, self.step = model, opt, 0

    def state_dict(self):
        m, o = get_state_dict(self.model, self.opt)
        return {"model": m, "opt": o, "step": self.step}

    def load_state_dict(self, sd):
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["opt"])
        self.step = sd["step"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--tokenizer", default="meta-llama/Meta-Llama-3-8B")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--steps", type=int, default=50000)
    ap.add_argument("--warmup", type=int, default=1000)
    args = ap.parse_args()

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]
    gloo = dist.new_group(backend="gloo")

    token_file = prepare_tokens(args.corpus, args.tokenizer)
    train_ds = FlatTokens(token_file, args.seq_len, "train")
    val_ds = FlatTokens(token_file, args.seq_len, "val")
    tsamp = DistributedSampler(train_ds, num_replicas=dp.size(), rank=dp.get_local_rank(), seed=0, drop_last=True)
    vsamp = DistributedSampler(val_ds, num_replicas=dp.size(), rank=dp.get_local_rank(), shuffle=False)
    tload = DataLoader(train_ds, batch_size=args.bs, sampler=tsamp, num_workers=4, pin_memory=True)
    vload = DataLoader(val_ds, batch_size=args.bs, sampler=vsamp, num_workers=2)

    vocab = 128256
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Model(vocab, seq_len=args.seq_len)
    parallelize(model, mesh)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=0.02)
    model.tab = rotary_table(model.hd, args.seq_len).cuda()

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / args.warmup if s < args.warmup
        else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - args.warmup) / (args.steps - args.warmup))))
    state = Ckpt(model, opt)
    ck_root = os.path.join(args.out, "ckpt")
    saved = sorted(glob.glob(os.path.join(ck_root, "*", ".metadata")))
    if saved:
        dcp.load({"s": state}, checkpoint_id=os.path.dirname(saved[-1]))
        for _ in range(state.step):
            sched.step()

    epoch = state.step // len(tload)
    tsamp.set_epoch(epoch)
    it = iter(tload)
    fut = None
    t0 = time.time()
    while state.step < args.steps:
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            tsamp.set_epoch(epoch)
            it = iter(tload)
            x, y = next(it)
        loss = F.cross_entropy(model(x.cuda(non_blocking=True)).flatten(0, 1).float(),
                               y.cuda(non_blocking=True).flatten())
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        state.step += 1

        if state.step % 20 == 0:
            l = loss.detach().clone()
            dist.all_reduce(l, op=dist.ReduceOp.AVG, group=dp.get_group())
            if rank == 0:
                print(f"step {state.step} loss {l.item():.4f} gn {gn.item():.2f} "
                      f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 20:.2f}s/it", flush=True)
            t0 = time.time()

        if state.step % 1000 == 0:
            model.eval()
            acc = torch.zeros(2, device="cuda")
            with torch.no_grad():
                for vx, vy in vload:
                    out = model(vx.cuda())
                    acc[0] += F.cross_entropy(out.flatten(0, 1).float(), vy.cuda().flatten(), reduction="sum")
                    acc[1] += vy.numel()
            dist.all_reduce(acc, group=dp.get_group())
            model.train()
            if rank == 0:
                print(f"step {state.step} val_loss {(acc[0] / acc[1]).item():.4f}", flush=True)
            if fut is not None:
                fut.result()
            fut = dcp.async_save({"s": state}, checkpoint_id=os.path.join(ck_root, f"{state.step:08d}"),
                                 process_group=gloo)

    if fut is not None:
        fut.result()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
