"""Continued pretraining of a 1.3B GPT on the code corpus, FSDP + sharded DCP checkpoints.

Volcano Job with the svc plugin, task "worker" (replicas: 4), 8 GPUs per pod.
No torchrun: every pod reads VC_TASK_INDEX / VC_WORKER_HOSTS / VC_WORKER_NUM,
and forks one process per GPU.

    tasks:
      - name: worker
        replicas: 4
        template:
          spec:
            containers:
              - command: ["python", "/app/pretrain_fsdp.py", "--data", "/shared/code-tok",
                          "--ckpt-dir", "/shared/ckpt/gpt1b3-code", "--max-steps", "60000"]
"""
import argparse
import functools
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="dir with train.bin / val.bin (uint16 tokens)")
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--max-steps", type=int, default=60000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-bs", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--eval-iters", type=int, default=20)
    p.add_argument("--save-every", type=int, default=1000)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args()


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.GELU(), nn.Linear(4 * d, d, bias=False))
        self.h = h

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=50304, d=2048, layers=24, heads=16, seq=2048):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def get_batch(data, seq, bs, gen, device):
    ix = torch.randint(len(data) - seq - 1, (bs,), generator=gen)
    x = torch.stack([torch.from_numpy(data[i:i + seq].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + seq].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.max_steps - args.warmup)
    return 0.1 * args.lr + 0.9 * args.lr * 0.5 * (1 + math.cos(math.pi * t))


def worker(local_rank, node_rank, nnodes, master, args):
    ngpu = torch.cuda.device_count()
    rank, world = node_rank * ngpu + local_rank, nnodes * ngpu
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", init_method=f"tcp://{master}:{args.port}", rank=rank, world_size=world)

    torch.manual_seed(args.seed)  # same init everywhere; FSDP syncs from rank 0 anyway
    model = GPT(seq=args.seq)
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDP(model, auto_wrap_policy=wrap, device_id=local_rank, use_orig_params=True,
                 sharding_strategy=ShardingStrategy.HYBRID_SHARD, sync_module_states=True,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, Block))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    step = 0
    latest = os.path.join(args.ckpt_dir, "latest.txt")
    if os.path.exists(latest):
        with open(latest) as fh:
            tag = fh.read().strip()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": 0}
        dcp.load(state, checkpoint_id=os.path.join(args.ckpt_dir, tag))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = int(state["step"])

    train = np.memmap(os.path.join(args.data, "train.bin"), dtype=np.uint16, mode="r")
    val = np.memmap(os.path.join(args.data, "val.bin"), dtype=np.uint16, mode="r")
    # every rank draws its own random windows; offset by step so a resume does not replay
    gen = torch.Generator().manual_seed(args.seed * 100003 + rank * 7919 + step)
    val_gen_seed = args.seed + rank

    if rank == 0:
        import wandb
        wandb.init(project="gpt-code", name=os.environ.get("VC_JOB_NAME", "gpt1b3"), resume="allow",
                   config=vars(args) | {"world": world})

    model.train()
    t0 = time.time()
    while step < args.max_steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        x, y = get_batch(train, args.seq, args.micro_bs, gen, device)
        loss = model(x, y)
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        if step % 10 == 0:
            l = loss.detach().clone()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                tps = 10 * args.micro_bs * args.seq * world / (time.time() - t0)
                wandb.log({"train/loss": l.item(), "lr": lr_at(step, args), "tok_per_s": tps}, step=step)
            t0 = time.time()

        if step % args.eval_every == 0:
            model.eval()
            vg = torch.Generator().manual_seed(val_gen_seed)
            tot = torch.zeros((), device=device)
            with torch.no_grad():
                for _ in range(args.eval_iters):
                    tot += model(*get_batch(val, args.seq, args.micro_bs, vg, device))
            dist.all_reduce(tot, op=dist.ReduceOp.AVG)
            if rank == 0:
                wandb.log({"val/loss": tot.item() / args.eval_iters}, step=step)
            model.train()

        if step % args.save_every == 0 or step == args.max_steps:
            msd, osd = get_state_dict(model, opt)
            tag = f"step_{step:07d}"
            dcp.save({"model": msd, "optim": osd, "step": step},
                     checkpoint_id=os.path.join(args.ckpt_dir, tag))
            dist.barrier()
            if rank == 0:
                with open(latest + ".tmp", "w") as fh:
                    fh.write(tag)
                os.replace(latest + ".tmp", latest)

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


def main():
    args = get_args()
    node_rank = int(os.environ["VC_TASK_INDEX"])
    hosts = os.environ["VC_WORKER_HOSTS"].split(",")
    nnodes = int(os.environ.get("VC_WORKER_NUM", len(hosts)))
    os.makedirs(args.ckpt_dir, exist_ok=True)
    mp.spawn(worker, args=(node_rank, nnodes, hosts[0], args), nprocs=torch.cuda.device_count(), join=True)


if __name__ == "__main__":
    main()
