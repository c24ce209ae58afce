"""Pretraining from many .npy token shards with an infinite IterableDataset.

FSDP2 over "dp", TP over "tp". Steps whose global gradient norm is not finite
are skipped (all ranks see the same norm, so they skip together).

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        shards_pretrain.py --shards '/weka/tok/dclm/*.npy' --tp 2 --out /weka/runs/dclm-3b
"""
import argparse
import glob
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
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


class ShardStream(IterableDataset):
    """Endless stream of fixed-length windows.

    Shard files are split over data-parallel ranks (TP peers share a dp rank and
    therefore read identical data), then over DataLoader workers. The stream never
    ends, so every rank can always produce the next batch.
    """

    def __init__(self, files, seq_len, dp_rank, dp_size, seed):
        assert len(files) >= dp_size, f"need at least {dp_size} shard files, got {len(files)}"
        self.files = files[dp_rank::dp_size]
        self.seq_len, self.seed, self.dp_rank = seq_len, seed, dp_rank

    def __iter__(self):
        wi = get_worker_info()
        wid, nw = (wi.id, wi.num_workers) if wi else (0, 1)
        assert len(self.files) >= nw, "fewer shard files than DataLoader workers on this rank"
        mine = self.files[wid::nw]
        rng = np.random.default_rng((self.seed, self.dp_rank, wid))
        while True:
            for path in rng.permutation(mine):
                a = np.load(path, mmap_mode="r")
                n = (len(a) - 1) // self.seq_len
                for j in rng.permutation(n):
                    w = torch.from_numpy(a[j * self.seq_len: (j + 1) * self.seq_len + 1].astype(np.int64))
                    yield w[:-1], w[1:]


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * self.weight


def rope_tab(hd, n):
    a = torch.outer(torch.arange(n).float(), 10000.0 ** (-torch.arange(0, hd, 2).float() / hd))
    return torch.polar(torch.ones_like(a), a)


def rope(x, tab):
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * tab[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, d, nh):
        super().__init__()
        self.hd = d // nh
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x, tab):
        b, t, _ = x.shape
        q = rope(self.wq(x).view(b, t, -1, self.hd), tab).transpose(1, 2)
        k = rope(self.wk(x).view(b, t, -1, self.hd), tab).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.hd).transpose(1, 2)
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, d, nh, ff):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(d), RMSNorm(d)
        self.attention = Attention(d, nh)
        self.feed_forward = nn.ModuleDict({"w1": nn.Linear(d, ff, bias=False), "w3": nn.Linear(d, ff, bias=False),
                                           "w2": nn.Linear(ff, d, bias=False)})

    def forward(self, x, tab):
        x = x + self.attention(self.attention_norm(x), tab)
        h = self.ffn_norm(x)
        f = self.feed_forward
        return x + f["w2"](F.silu(f["w1"](h)) * f["w3"](h))


class LM(nn.Module):
    def __init__(self, vocab=50432, d=3072, n_layers=26, nh=24, ff=8192, seq_len=2048):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, nh, ff) for _ in range(n_layers))
        self.norm = RMSNorm(d)
        self.output = nn.Linear(d, vocab, bias=False)
        self.hd, self.seq_len = d // nh, seq_len
        self.register_buffer("tab", rope_tab(self.hd, seq_len), persistent=False)

    def forward(self, idx):
        h = self.tok_embeddings(idx)
        for blk in self.layers:
            h = blk(h, self.tab)
        return self.output(self.norm(h))


def parallelize(model, mesh, ac_mode):
    tp = mesh["tp"]
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
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
        # "full": every block; "half": every other block (same choice on every rank)
        if ac_mode == "full" or (ac_mode == "half" and i % 2 == 0):
            blk = checkpoint_wrapper(blk, preserve_rng_state=False)
        blk = torch.compile(blk)
        fully_shard(blk, mesh=mesh["dp"], mp_policy=mp)
        model.layers[i] = blk
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", required=True)
    ap.add_argument("--val-shards", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--ac", choices=["none", "half", "full"], default="half")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]

    files = sorted(glob.glob(args.shards))
    val_files = sorted(glob.glob(args.val_shards)) if args.val_shards else files[-1:]
    train_stream = ShardStream(files, args.seq_len, dp.get_local_rank(), dp.size(), args.seed)
    val_stream = ShardStream(val_files, args.seq_len, dp.get_local_rank(), dp.size(), args.seed + 1)
    train_it = iter(DataLoader(train_stream, batch_size=args.bs, num_workers=4, pin_memory=True))

    torch.manual_seed(args.seed)
    with torch.device("meta"):
        model = LM(seq_len=args.seq_len)
    parallelize(model, mesh, args.ac)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                nn.init.trunc_normal_(p, std=0.02, a=-0.04, b=0.04)
    model.tab = rope_tab(model.hd, args.seq_len).cuda()

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / args.warmup if s < args.warmup
        else 0.5 * (1 + math.cos(math.pi * min(1.0, (s - args.warmup) / (args.steps - args.warmup)))))

    step = 0
    ckpts = sorted(glob.glob(os.path.join(args.out, "step-*", ".metadata")))
    if ckpts:
        m, o = get_state_dict(model, opt)
        sd = {"model": m, "optim": o, "sched": sched.state_dict(), "step": 0}
        dcp.load(sd, checkpoint_id=os.path.dirname(ckpts[-1]))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        sched.load_state_dict(sd["sched"])
        step = sd["step"]

    skipped, fut = 0, None
    t0 = time.time()
    while step < args.steps:
        x, y = next(train_it)
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
        if not torch.isfinite(gn):
            # global norm -> identical on every rank; all ranks skip this update together
            opt.zero_grad(set_to_none=True)
            skipped += 1
            if rank == 0:
                print(f"step {step}: non-finite grad norm, update skipped ({skipped} so far)", flush=True)
            continue
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        step += 1

        if step % 20 == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG, group=dp.get_group())
            if rank == 0:
                print(f"step {step} loss {l.item():.4f} gn {gn.item():.2f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / 20:.3f}s/step", flush=True)
            t0 = time.time()

        if step % 2000 == 0:
            model.eval()
            val_it = iter(DataLoader(val_stream, batch_size=args.bs, num_workers=1))
            acc = torch.zeros(2, device="cuda")
            with torch.no_grad():
                for _ in range(50):  # fixed count on every rank; the stream never runs dry
                    vx, vy = next(val_it)
                    out = model(vx.cuda())
                    acc[0] += F.cross_entropy(out.flatten(0, 1).float(), vy.cuda().flatten(), reduction="sum")
                    acc[1] += vy.numel()
            del val_it
            dist.all_reduce(acc, group=dp.get_group())
            model.train()
            if rank == 0:
                print(f"step {step} val_loss {(acc[0] / acc[1]).item():.4f}", flush=True)

            if fut is not None:
                fut.result()
            m, o = get_state_dict(model, opt)
            fut = dcp.async_save({"model": m, "optim": o, "sched": sched.state_dict(), "step": step},
                                 checkpoint_id=os.path.join(args.out, f"step-{step:07d}"))

    if fut is not None:
        fut.result()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
