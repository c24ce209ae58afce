#!/usr/bin/env python3
# Llama-2-7B-shaped model from scratch, PP x FSDP2 x TP, bf16 params via FSDP2 mixed precision.
# torch 2.5 cluster image.
#
#   torchrun --nnodes=4 --nproc_per_node=8 --rdzv_id=$SLURM_JOB_ID --rdzv_backend=c10d \
#       --rdzv_endpoint=$MASTER_ADDR:29500 pretrain_7b.py --pp 4 --tp 4
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
from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed._tensor import Replicate
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-bin", default="/data/slimpajama/train_llama2tok.bin")
    p.add_argument("--save-dir", default="/checkpoints/llama7b_scratch")
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--num-microbatches", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--train-steps", type=int, default=250_000)
    p.add_argument("--save-interval", type=int, default=2000)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class ModelCfg:
    dim = 4096
    n_layers = 32
    n_heads = 32
    ffn_dim = 11008
    vocab = 32000
    eps = 1e-5


def rotary_tables(head_dim, seq_len, device, theta=10000.0):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    t = torch.arange(seq_len, device=device).float()
    freqs = torch.outer(t, inv)
    return freqs.cos(), freqs.sin()


def apply_rotary(x, cos, sin):
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.hd = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        q = apply_rotary(self.wq(x).view(B, S, -1, self.hd), cos, sin).transpose(1, 2)
        k = apply_rotary(self.wk(x).view(B, S, -1, self.hd), cos, sin).transpose(1, 2)
        v = self.wv(x).view(B, S, -1, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, S, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.dim, eps=cfg.eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.dim, eps=cfg.eps)
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class StageModule(nn.Module):
    def __init__(self, cfg, seq_len, layer_range, has_embed, has_head):
        super().__init__()
        self.cfg, self.seq_len = cfg, seq_len
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.dim) if has_embed else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg) for i in layer_range})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.eps) if has_head else None
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False) if has_head else None

    def forward(self, x):
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        cos, sin = rotary_tables(self.cfg.dim // self.cfg.n_heads, x.shape[1], x.device)
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


class BinTokens(Dataset):
    def __init__(self, path, seq_len):
        self.mm = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (self.mm.shape[0] - 1) // self.seq_len

    def __getitem__(self, i):
        o = i * self.seq_len
        t = torch.from_numpy(self.mm[o:o + self.seq_len + 1].astype(np.int64))
        return t[:-1], t[1:]


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // (args.pp * args.tp)
    mesh = init_device_mesh("cuda", (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank = mesh["pp"].get_local_rank()
    dp_rank = mesh["dp"].get_local_rank()
    first, last = pp_rank == 0, pp_rank == args.pp - 1
    torch.manual_seed(args.seed)

    cfg = ModelCfg()
    per = cfg.n_layers // args.pp
    with torch.device("meta"):
        model = StageModule(cfg, args.seq_len, range(pp_rank * per, (pp_rank + 1) * per), first, last)

    tp_mesh = mesh["tp"]
    if first:
        parallelize_module(model, tp_mesh, {"embed_tokens": RowwiseParallel(input_layouts=Replicate())})
    if last:
        parallelize_module(model, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    for layer in model.layers.values():
        parallelize_module(layer, tp_mesh, {
            "self_attn.wq": ColwiseParallel(),
            "self_attn.wk": ColwiseParallel(),
            "self_attn.wv": ColwiseParallel(),
            "self_attn.wo": RowwiseParallel(),
            "gate_proj": ColwiseParallel(),
            "up_proj": ColwiseParallel(),
            "down_proj": RowwiseParallel(),
        })
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh["dp"], mp_policy=mp_policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp_policy, reshard_after_forward=False)

    model.to_empty(device=device)
    with torch.no_grad():
        for n, prm in model.named_parameters():
            if "layernorm" in n or n.startswith("norm"):
                prm.fill_(1.0)
            else:
                prm.normal_(mean=0.0, std=0.02)

    # example tensors so the stage knows what it receives / sends
    mb = args.micro_batch_size
    if first:
        stage_in = torch.zeros(mb, args.seq_len, dtype=torch.long, device=device)
    else:
        stage_in = torch.empty(mb, args.seq_len, cfg.dim, device=device)
    if last:
        stage_out = torch.empty(mb, args.seq_len, cfg.vocab, device=device)
    else:
        stage_out = torch.empty(mb, args.seq_len, cfg.dim, device=device)
    stage = PipelineStage(model, pp_rank, args.pp, device,
                          input_args=(stage_in,), output_args=(stage_out,),
                          group=mesh["pp"].get_group())

    def lm_loss(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))

    schedule = Schedule1F1B(stage, n_microbatches=args.num_microbatches, loss_fn=lm_loss)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1, eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min((s + 1) / args.warmup,
                      0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / args.train_steps)))),
    )

    ds = BinTokens(args.train_bin, args.seq_len)
    sampler = DistributedSampler(ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=mb * args.num_microbatches, sampler=sampler,
                        num_workers=4, pin_memory=True, drop_last=True)

    step = 0
    resume = os.path.join(args.save_dir, "latest")
    if os.path.exists(os.path.join(resume, ".metadata")):
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd, "sched": sched.state_dict(), "step": 0}
        dcp.load(state, checkpoint_id=resume)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        sched.load_state_dict(state["sched"])
        step = state["step"]

    epoch = 0
    sampler.set_epoch(epoch)
    data_iter = iter(loader)
    tic = time.time()
    while step < args.train_steps:
        try:
            tokens, labels = next(data_iter)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            data_iter = iter(loader)
            tokens, labels = next(data_iter)

        optimizer.zero_grad(set_to_none=True)
        losses = [] if last else None
        if first:
            schedule.step(tokens.to(device, non_blocking=True))
        elif last:
            schedule.step(target=labels.to(device, non_blocking=True), losses=losses)
        else:
            schedule.step()
        optimizer.step()
        sched.step()
        step += 1

        if step % 10 == 0:
            loss = torch.stack(losses).mean().detach() if last else torch.tensor(0.0, device=device)
            dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=mesh["pp"].get_group())
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
            if rank == 0:
                elapsed = time.time() - tic
                tps = 10 * mb * args.num_microbatches * dp * args.seq_len / elapsed
                print(f"[step {step}] loss={loss.item():.4f} lr={sched.get_last_lr()[0]:.3e} "
                      f"tokens/s={tps:,.0f}", flush=True)
            tic = time.time()

        if step % args.save_interval == 0:
            msd, osd = get_state_dict(model, optimizer)
            state = {"model": msd, "optim": osd, "sched": sched.state_dict(), "step": step}
            path = os.path.join(args.save_dir, f"step{step}")
            dcp.save(state, checkpoint_id=path)
            dist.barrier()
            if rank == 0:
                if os.path.islink(resume):
                    os.unlink(resume)
                os.symlink(os.path.basename(path), resume)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
