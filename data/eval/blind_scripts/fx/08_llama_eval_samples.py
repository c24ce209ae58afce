"""Small-scale Llama pretraining (~1B) used for data-mixture ablations.

Each ablation runs on one node: FSDP2 over 4 dp ranks x TP 2. Periodically we
compute held-out loss and print a few greedy samples to eyeball the run.

    torchrun --standalone --nproc_per_node=8 ablate.py --mix configs/mix_b.json --run mix_b
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoTokenizer

D, L, H, KV, FF, V, T = 2048, 16, 16, 8, 5632, 32000, 2048


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * self.weight


def rope_cache(n=T, hd=D // H, base=10000.0):
    a = torch.outer(torch.arange(n).float(), 1.0 / base ** (torch.arange(0, hd, 2).float() / hd))
    return torch.polar(torch.ones_like(a), a)


def apply_rope(x, c):
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * c[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.hd = D // H
        self.wq, self.wk = nn.Linear(D, H * self.hd, bias=False), nn.Linear(D, KV * self.hd, bias=False)
        self.wv, self.wo = nn.Linear(D, KV * self.hd, bias=False), nn.Linear(H * self.hd, D, bias=False)

    def forward(self, x, c):
        b, t, _ = x.shape
        q = apply_rope(self.wq(x).view(b, t, -1, self.hd), c).transpose(1, 2)
        k = apply_rope(self.wk(x).view(b, t, -1, self.hd), c).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FFN(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(D, FF, bias=False), nn.Linear(D, FF, bias=False), nn.Linear(FF, D, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(D), Attention()
        self.ffn_norm, self.feed_forward = RMSNorm(D), FFN()

    def forward(self, x, c):
        x = x + self.attention(self.attention_norm(x), c)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Block() for _ in range(L)])
        self.norm = RMSNorm(D)
        self.output = nn.Linear(D, V, bias=False)
        self.register_buffer("rope", rope_cache(), persistent=False)

    def forward(self, ids):
        h = self.tok_embeddings(ids)
        for blk in self.layers:
            h = blk(h, self.rope)
        return self.output(self.norm(h))


class MixtureDataset(Dataset):
    """Fixed-length windows drawn from several token files according to mixture weights."""

    def __init__(self, mix, split, n_samples, seed=0):
        self.files = {k: np.memmap(v["path"].format(split=split), dtype=np.uint16, mode="r") for k, v in mix.items()}
        names = list(mix)
        w = np.array([mix[k]["weight"] for k in names], dtype=np.float64)
        rng = np.random.default_rng(seed)
        picks = rng.choice(len(names), size=n_samples, p=w / w.sum())
        self.index = [(names[j], int(rng.integers(0, len(self.files[names[j]]) - T - 1))) for j in picks]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        name, off = self.index[i]
        a = torch.from_numpy(self.files[name][off: off + T + 1].astype(np.int64))
        return a[:-1], a[1:]


def build(mesh):
    with torch.device("meta"):
        model = Llama()
    tp = mesh["tp"]
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for i, blk in enumerate(model.layers):
        parallelize_module(blk, tp, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
        model.layers[i] = torch.compile(checkpoint_wrapper(blk, preserve_rng_state=False))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.layers:
        fully_shard(blk, mesh=mesh["dp"], mp_policy=mp)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.fill_(1.0)
            else:
                nn.init.trunc_normal_(p, std=0.02)
        model.rope = rope_cache().cuda()
    return model


@torch.no_grad()
def evaluate(model, loader, tok, prompts):
    model.eval()
    tot, n = 0.0, 0
    for x, y in loader:
        logits = model(x.cuda())
        tot += F.cross_entropy(logits.flatten(0, 1).float(), y.cuda().flatten(), reduction="sum").item()
        n += y.numel()
    samples = []
    for p in prompts:
        ids = torch.tensor([tok.encode(p)], device="cuda")
        for _ in range(32):
            nxt = model(ids)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        samples.append(tok.decode(ids[0].tolist()))
    model.train()
    return tot / n, samples


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mix", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--root", default="/checkpoint/ablations")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--save-every", type=int, default=2000)
    args = ap.parse_args()

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]
    random.seed(0)
    torch.manual_seed(0)

    with open(args.mix) as f:
        mix = json.load(f)
    tok = AutoTokenizer.from_pretrained("meta-llama/Llama-2-7b-hf")
    prompts = ["The capital of France is", "def fibonacci(n):", "In 1905, Einstein"]

    model = build(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 1000) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))

    train_ds = MixtureDataset(mix, "train", n_samples=args.steps * args.bs * dp.size(), seed=0)
    val_ds = MixtureDataset(mix, "val", n_samples=256, seed=1)
    sampler = DistributedSampler(train_ds, num_replicas=dp.size(), rank=dp.get_local_rank(), shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=args.bs, shuffle=False)

    run_dir = os.path.join(args.root, args.run)
    step, fut = 0, None
    t0 = time.time()
    for x, y in train_loader:
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        step += 1

        if step % 20 == 0:
            l = loss.detach().clone()
            dist.all_reduce(l, op=dist.ReduceOp.AVG, group=dp.get_group())
            gn = gn.full_tensor()
            if rank == 0:
                print(f"{args.run} step {step} loss {l.item():.4f} gnorm {gn.item():.3f} "
                      f"{(time.time() - t0) / 20:.2f}s/it", flush=True)
            t0 = time.time()

        if step % args.eval_every == 0 and rank == 0:
            vloss, samples = evaluate(model, val_loader, tok, prompts)
            print(f"{args.run} step {step} val_loss {vloss:.4f} ppl {math.exp(vloss):.2f}", flush=True)
            for s in samples:
                print("   >>", s.replace("\n", " "), flush=True)

        if step % args.save_every == 0:
            if fut is not None:
                fut.result()
            msd, osd = get_state_dict(model, opt)
            fut = dcp.async_save({"model": msd, "optim": osd, "step": step},
                                 checkpoint_id=os.path.join(run_dir, f"step_{step}"))
        if step >= args.steps:
            break

    if fut is not None:
        fut.result()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
