"""Qwen-style 4B pretraining run (QKV bias, GQA) with FSDP2 + TP + loss parallel.

Global batch is fixed in sequences; gradient accumulation is derived from the
data-parallel degree so the recipe is the same on 16 or 64 GPUs.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        qwen_pretrain.py --tp 4 --global-batch 256 --micro-batch 2 --data /fsx/tok/mix-v3
"""
import argparse
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Cfg:
    hidden = 2560
    layers = 36
    heads = 32
    kv_heads = 8
    inter = 9728
    vocab = 151936
    theta = 1_000_000.0


class Norm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        v = x.float()
        return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_table(hd, n, theta):
    ang = torch.outer(torch.arange(n).float(), 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd))
    return torch.polar(torch.ones_like(ang), ang)


def rope(x, tab):
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * tab[: x.size(1)][None, :, None]
    return torch.view_as_real(z).flatten(3).to(x.dtype)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        c = Cfg
        self.hd = c.hidden // c.heads
        self.q = nn.Linear(c.hidden, c.heads * self.hd, bias=True)
        self.k = nn.Linear(c.hidden, c.kv_heads * self.hd, bias=True)
        self.v = nn.Linear(c.hidden, c.kv_heads * self.hd, bias=True)
        self.o = nn.Linear(c.heads * self.hd, c.hidden, bias=False)

    def forward(self, h, tab):
        b, t, _ = h.shape
        q = rope(self.q(h).view(b, t, -1, self.hd), tab).transpose(1, 2)
        k = rope(self.k(h).view(b, t, -1, self.hd), tab).transpose(1, 2)
        v = self.v(h).view(b, t, -1, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(o.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(Cfg.hidden, Cfg.inter, bias=False)
        self.up = nn.Linear(Cfg.hidden, Cfg.inter, bias=False)
        self.down = nn.Linear(Cfg.inter, Cfg.hidden, bias=False)

    def forward(self, h):
        return self.down(F.silu(self.gate(h)) * self.up(h))


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_norm, self.post_norm = Norm(Cfg.hidden), Norm(Cfg.hidden)
        self.attn = Attention()
        self.mlp = MLP()

    def forward(self, x, tab):
        x = x + self.attn(self.input_norm(x), tab)
        return x + self.mlp(self.post_norm(x))


class QwenLM(nn.Module):
    def __init__(self, seq_len):
        super().__init__()
        self.seq_len = seq_len
        self.embed = nn.Embedding(Cfg.vocab, Cfg.hidden)
        self.layers = nn.ModuleDict({str(i): DecoderLayer() for i in range(Cfg.layers)})
        self.norm = Norm(Cfg.hidden)
        self.lm_head = nn.Linear(Cfg.hidden, Cfg.vocab, bias=False)
        self.register_buffer("tab", rope_table(Cfg.hidden // Cfg.heads, seq_len, Cfg.theta), persistent=False)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers.values():
            h = layer(h, self.tab)
        return self.lm_head(self.norm(h))


def parallelize(model, mesh):
    tp = mesh["tp"]
    # lm_head output stays sharded over the vocab; the loss is computed under loss_parallel()
    parallelize_module(model, tp, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for layer in model.layers.values():
        parallelize_module(layer, tp, {
            "input_norm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(output_layouts=Shard(1)),
            "post_norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
        })
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for lid, layer in model.layers.items():
        layer = torch.compile(checkpoint_wrapper(layer, preserve_rng_state=False))
        fully_shard(layer, mesh=mesh["dp"], mp_policy=mp)
        model.layers[lid] = layer
    # root holds embed/norm/lm_head; keep them gathered between forward and backward
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)


class Blocks(Dataset):
    def __init__(self, path, seq_len):
        self.t = np.memmap(path, dtype=np.uint32, mode="r")
        self.L = seq_len

    def __len__(self):
        return (len(self.t) - 1) // self.L

    def __getitem__(self, i):
        a = torch.from_numpy(self.t[i * self.L: (i + 1) * self.L + 1].astype(np.int64))
        return a[:-1], a[1:]


@torch.no_grad()
def evaluate(model, loader, max_batches):
    model.eval()
    s = torch.zeros(2, device="cuda", dtype=torch.float64)
    for i, (x, y) in enumerate(loader):
        if i >= max_batches:
            break
        x, y = x.cuda(), y.cuda()
        with loss_parallel():
            l = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        s[0] += l.full_tensor().double() * y.numel() if hasattr(l, "full_tensor") else l.double() * y.numel()
        s[1] += y.numel()
    # reduced over the whole world (TP replicas count the same tokens, the ratio is unchanged)
    # so every rank ends up with a bit-identical value
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def write_meta(path, meta):
    with open(path + ".tmp", "w") as f:
        json.dump(meta, f)
    os.replace(path + ".tmp", path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="/fsx/runs/qwen4b")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=60000)
    ap.add_argument("--eval-every", type=int, default=1000)
    args = ap.parse_args()

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]
    dp_size, dp_rank = dp.size(), dp.get_local_rank()

    assert args.global_batch % (args.micro_batch * dp_size) == 0, "global batch must split evenly over dp"
    accum = args.global_batch // (args.micro_batch * dp_size)

    torch.manual_seed(42)
    with torch.device("meta"):
        model = QwenLM(args.seq_len)
    parallelize(model, mesh)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.fill_(1.0)
            elif n.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    model.tab = rope_table(Cfg.hidden // Cfg.heads, args.seq_len, Cfg.theta).cuda()

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / args.warmup,
                                              0.1 + 0.45 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))))

    step, best = 0, float("inf")
    meta_path = os.path.join(args.out, "state.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=os.path.join(args.out, meta["last"]))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        step, best = meta["step"], meta["best"]
        for _ in range(step):
            sched.step()

    train = Blocks(os.path.join(args.data, "train.bin"), args.seq_len)
    val = Blocks(os.path.join(args.data, "val.bin"), args.seq_len)
    tsamp = DistributedSampler(train, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=42, drop_last=True)
    vsamp = DistributedSampler(val, num_replicas=dp_size, rank=dp_rank, shuffle=False)
    tl = DataLoader(train, batch_size=args.micro_batch, sampler=tsamp, num_workers=4, pin_memory=True, drop_last=True)
    vl = DataLoader(val, batch_size=args.micro_batch, sampler=vsamp, num_workers=2)

    epoch = step * accum // len(tl)
    tsamp.set_epoch(epoch)
    it = iter(tl)
    save_fut, last_saved = None, None
    t0 = time.time()
    while step < args.steps:
        total = torch.zeros((), device="cuda")
        for micro in range(accum):
            try:
                x, y = next(it)
            except StopIteration:
                epoch += 1
                tsamp.set_epoch(epoch)
                it = iter(tl)
                x, y = next(it)
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            # reduce-scatter only on the last micro-batch
            model.set_requires_gradient_sync(micro == accum - 1)
            with loss_parallel():
                loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()) / accum
                loss.backward()
            total += loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()
        gn = nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True).full_tensor()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        step += 1

        if step % 10 == 0:
            dist.all_reduce(total, op=dist.ReduceOp.AVG, group=dp.get_group())
            if rank == 0:
                print(f"step {step} loss {total.item():.4f} gnorm {gn.item():.2f} "
                      f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 10:.2f}s/step", flush=True)
            t0 = time.time()

        if step % args.eval_every == 0:
            # every rank gets the same reduced value, so every rank takes the same branch below
            vloss = evaluate(model, vl, max_batches=100)
            if save_fut is not None:
                save_fut.result()
                if rank == 0:
                    write_meta(meta_path, last_saved)
            msd, osd = get_state_dict(model, opt)
            if vloss < best:
                best = vloss
                dcp.save({"model": msd}, checkpoint_id=os.path.join(args.out, "best"))
            tag = f"step{step}"
            save_fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(args.out, tag))
            last_saved = {"step": step, "best": best, "last": tag}
            if rank == 0:
                print(f"step {step} val {vloss:.4f} best {best:.4f}", flush=True)

    if save_fut is not None:
        save_fut.result()
        if rank == 0:
            write_meta(meta_path, last_saved)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
