#!/usr/bin/env python
# Qwen-style decoder (qkv bias, GQA, SwiGLU) pretrained with PP x FSDP2 x TP.
#
# 4 nodes x 8 H100:
#   torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
#       pretrain_qwenish.py --pp 4 --tp 4 --out /fsx/runs/qwenish_4b
import argparse
import json
import math
import os
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, DistributedSampler

ARCH = {"hidden": 2560, "layers": 36, "heads": 20, "kv_heads": 4, "inter": 9728, "vocab": 151936, "theta": 1e6}


class QwenAttention(nn.Module):
    def __init__(self):
        super().__init__()
        h, nh, kv = ARCH["hidden"], ARCH["heads"], ARCH["kv_heads"]
        self.hd, self.groups = h // nh, nh // kv
        self.q_proj = nn.Linear(h, nh * self.hd, bias=True)
        self.k_proj = nn.Linear(h, kv * self.hd, bias=True)
        self.v_proj = nn.Linear(h, kv * self.hd, bias=True)
        self.o_proj = nn.Linear(nh * self.hd, h, bias=False)

    @staticmethod
    def rope(x):
        s, d = x.shape[1], x.shape[-1]
        inv = 1.0 / (ARCH["theta"] ** (torch.arange(0, d, 2, device=x.device).float() / d))
        ang = torch.outer(torch.arange(s, device=x.device).float(), inv)
        cos, sin = torch.cat([ang.cos()] * 2, -1)[None, :, None], torch.cat([ang.sin()] * 2, -1)[None, :, None]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return (x.float() * cos + torch.cat([-x2, x1], -1).float() * sin).type_as(x)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.rope(self.q_proj(x).view(b, s, -1, self.hd)).transpose(1, 2)
        k = self.rope(self.k_proj(x).view(b, s, -1, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.hd).transpose(1, 2)
        k, v = k.repeat_interleave(self.groups, 1), v.repeat_interleave(self.groups, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


class QwenLayer(nn.Module):
    def __init__(self):
        super().__init__()
        h = ARCH["hidden"]
        self.input_layernorm = nn.RMSNorm(h, eps=1e-6)
        self.self_attn = QwenAttention()
        self.post_attention_layernorm = nn.RMSNorm(h, eps=1e-6)
        self.gate_proj = nn.Linear(h, ARCH["inter"], bias=False)
        self.up_proj = nn.Linear(h, ARCH["inter"], bias=False)
        self.down_proj = nn.Linear(ARCH["inter"], h, bias=False)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class QwenStage(nn.Module):
    def __init__(self, layer_ids, has_embed, has_head):
        super().__init__()
        self.embed_tokens = nn.Embedding(ARCH["vocab"], ARCH["hidden"]) if has_embed else None
        self.layers = nn.ModuleDict({str(i): QwenLayer() for i in layer_ids})
        self.norm = nn.RMSNorm(ARCH["hidden"], eps=1e-6) if has_head else None
        self.lm_head = nn.Linear(ARCH["hidden"], ARCH["vocab"], bias=False) if has_head else None

    def forward(self, x):
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.lm_head(self.norm(x)) if self.lm_head is not None else x


class PackedSamples(Dataset):
    def __init__(self, path, seq_len):
        self.data = np.memmap(path, dtype=np.uint32, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (self.data.size - 1) // self.seq_len

    def __getitem__(self, i):
        w = torch.from_numpy(self.data[i * self.seq_len: (i + 1) * self.seq_len + 1].astype(np.int64))
        return w[:-1], w[1:]


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/fsx/data/mix_qwen_tok/train.u32")
    ap.add_argument("--out", default="/fsx/runs/qwenish")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--min-lr", type=float, default=3e-5)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=120_000)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--ckpt-every", type=int, default=2000)
    return ap.parse_args()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group(backend="nccl", timeout=timedelta(minutes=30), device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // (args.pp * args.tp)
    mesh = init_device_mesh("cuda", (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    is_first, is_last = pp_rank == 0, pp_rank == args.pp - 1
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump({**vars(args), "dp": dp, "world": world}, f, indent=2)

    per = ARCH["layers"] // args.pp
    with torch.device("meta"):
        model = QwenStage(range(pp_rank * per, (pp_rank + 1) * per), is_first, is_last)
    tp_mesh = mesh["tp"]
    if is_first:
        parallelize_module(model, tp_mesh, {"embed_tokens": RowwiseParallel(input_layouts=Replicate())})
    if is_last:
        parallelize_module(model, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    for layer in model.layers.values():
        parallelize_module(layer, tp_mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel(),
        })
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    torch.manual_seed(1234)
    model.to_empty(device=device)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "layernorm" in n or n == "norm.weight":
                p.fill_(1.0)
            elif n.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)

    stage = PipelineStage(model, pp_rank, args.pp, device, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=args.microbatches,
                            loss_fn=lambda lg, tg: F.cross_entropy(lg.flatten(0, 1).float(), tg.flatten(0, 1)))

    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_for(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = min(1.0, (step - args.warmup) / (args.steps - args.warmup))
        return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * frac))

    ds = PackedSamples(args.data, args.seq_len)
    sampler = DistributedSampler(ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=1234, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=6, pin_memory=True,
                        drop_last=True, prefetch_factor=4)

    ckpt_dir = os.path.join(args.out, "checkpoint")
    step = 0
    if os.path.exists(os.path.join(ckpt_dir, ".metadata")):
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd, "step": 0}
        dcp.load(sd, checkpoint_id=ckpt_dir)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        step = sd["step"]
        if rank == 0:
            print(f"resumed from {ckpt_dir} @ step {step}", flush=True)

    epoch = step // len(loader)
    sampler.set_epoch(epoch)
    data = iter(loader)
    t_start = time.time()
    while step < args.steps:
        try:
            x, y = next(data)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            data = iter(loader)
            x, y = next(data)

        lr = lr_for(step)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        losses = [] if is_last else None
        if is_first:
            schedule.step(x.to(device, non_blocking=True))
        elif is_last:
            schedule.step(target=y.to(device, non_blocking=True), losses=losses)
        else:
            schedule.step()
        opt.step()
        step += 1

        if step % args.log_every == 0:
            loss_val = torch.stack(losses).mean().item() if is_last else 0.0
            stats = torch.tensor([loss_val, float(is_last)])
            # sum over pp picks the last stage's value, then average over replicas
            dist.all_reduce(stats, group=mesh["pp"].get_group())
            dist.all_reduce(stats, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
            if rank == 0:
                dt = (time.time() - t_start) / args.log_every
                toks = args.batch * dp * args.seq_len / dt
                print(f"step {step} | loss {stats[0].item():.4f} | lr {lr:.3e} | {toks / 1e6:.2f}M tok/s",
                      flush=True)
            t_start = time.time()

        if step % args.ckpt_every == 0 or step == args.steps:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd, "step": step}, checkpoint_id=ckpt_dir)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
