"""
Pretrain a ~350M Llama-style decoder with FSDP2 (fully_shard) on pre-tokenized
shards, with activation checkpointing, per-block torch.compile and sharded
checkpoints through torch.distributed.checkpoint.

Launched on Kubernetes as a Kubeflow PyTorchJob (4 pods x 8 GPUs); the
training-operator sets MASTER_ADDR / MASTER_PORT / WORLD_SIZE / RANK for each
pod and every pod runs:

    torchrun --nnodes=4 --nproc_per_node=8 \
        --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:$MASTER_PORT \
        --rdzv_id=$PET_RDZV_ID \
        02_fsdp2_pretrain_llama.py --data /mnt/data/fineweb_edu_tok --ckpt_dir /mnt/ckpt/llama350m
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
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, CheckpointImpl
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--ckpt_dir", required=True)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--micro_bs", type=int, default=8)
    p.add_argument("--grad_accum", type=int, default=2)
    p.add_argument("--max_steps", type=int, default=60000)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--min_lr", type=float, default=3e-5)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--save_every", type=int, default=1000)
    p.add_argument("--eval_every", type=int, default=500)
    p.add_argument("--compile", action="store_true")
    return p.parse_args()


class ShardedTokens:
    """Contiguous uint16 token shards; each data-parallel rank reads its own strided windows."""

    def __init__(self, pattern, seq_len, rank, world, seed=0):
        self.files = sorted(glob.glob(pattern))
        assert self.files, pattern
        self.seq_len = seq_len
        self.rank, self.world = rank, world
        self.rng = np.random.default_rng(seed)
        self.file_idx = 0
        self._load(0)

    def _load(self, i):
        self.tokens = np.memmap(self.files[i % len(self.files)], dtype=np.uint16, mode="r")
        self.pos = self.rank * (self.seq_len + 1)

    def next_batch(self, bs):
        stride = self.world * (self.seq_len + 1)
        if self.pos + (bs - 1) * stride + self.seq_len + 1 > len(self.tokens):
            self.file_idx += 1
            self._load(self.file_idx)
        rows = [self.tokens[self.pos + i * stride: self.pos + i * stride + self.seq_len + 1] for i in range(bs)]
        self.pos += bs * stride
        buf = torch.from_numpy(np.stack(rows).astype(np.int64))
        return buf[:, :-1], buf[:, 1:]

    def skip(self, n_batches, bs):
        # replay the position arithmetic of next_batch without touching the data
        stride = self.world * (self.seq_len + 1)
        for _ in range(n_batches):
            if self.pos + (bs - 1) * stride + self.seq_len + 1 > len(self.tokens):
                self.file_idx += 1
                self._load(self.file_idx)
            self.pos += bs * stride


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.max_steps - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def build_model(args):
    cfg = LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=args.seq_len,
        rope_theta=10000.0, tie_word_embeddings=False, attn_implementation="sdpa",
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return model


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)  # same init on every rank before sharding

    model = build_model(args)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = model.model.layers
    for i, block in enumerate(layers):
        block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        if args.compile:
            block = torch.compile(block)
        layers[i] = block
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)

    model.to_empty(device="cuda")
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            elif type(m).__name__ == "LlamaRMSNorm":
                nn.init.ones_(m.weight)
        model.model.rotary_emb.inv_freq.copy_(
            1.0 / (model.config.rope_theta ** (torch.arange(0, 64, 2, device="cuda").float() / 64)))

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    train = ShardedTokens(os.path.join(args.data, "train_*.bin"), args.seq_len, rank, world)
    val = ShardedTokens(os.path.join(args.data, "val_*.bin"), args.seq_len, rank, world)

    start_step = 0
    latest = os.path.join(args.ckpt_dir, "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            tag = f.read().strip()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": 0}
        dcp.load(state, checkpoint_id=os.path.join(args.ckpt_dir, tag))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start_step = state["step"]
        train.skip(start_step * args.grad_accum, args.micro_bs)
        if rank == 0:
            print(f"resumed from {tag} at step {start_step}", flush=True)

    tokens_per_step = args.micro_bs * args.seq_len * args.grad_accum * world
    if rank == 0:
        nparams = sum(p.numel() for p in model.parameters())
        print(f"params {nparams / 1e6:.1f}M world {world} tokens/step {tokens_per_step}", flush=True)

    model.train()
    t0 = time.time()
    for step in range(start_step, args.max_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)

        loss_acc = torch.zeros((), device="cuda")
        for micro in range(args.grad_accum):
            x, y = train.next_batch(args.micro_bs)
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            last = micro == args.grad_accum - 1
            model.set_requires_gradient_sync(last)
            logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1)) / args.grad_accum
            loss.backward()
            loss_acc += loss.detach()

        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if isinstance(gnorm, DTensor):
            gnorm = gnorm.full_tensor()
        opt.step()
        opt.zero_grad(set_to_none=True)

        if (step + 1) % 10 == 0:
            dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)
            if rank == 0:
                dt = time.time() - t0
                t0 = time.time()
                tps = tokens_per_step * 10 / dt
                print(f"step {step + 1} loss {loss_acc.item():.4f} gnorm {gnorm.item():.3f} "
                      f"lr {lr_at(step, args):.2e} tok/s {tps:,.0f}", flush=True)

        if (step + 1) % args.eval_every == 0:
            model.eval()
            vloss = torch.zeros(2, device="cuda")
            with torch.no_grad():
                for _ in range(20):
                    x, y = val.next_batch(args.micro_bs)
                    logits = model(input_ids=x.cuda()).logits
                    vloss[0] += F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.cuda().view(-1),
                                                reduction="sum")
                    vloss[1] += y.numel()
            dist.all_reduce(vloss)
            val.pos = val.rank * (val.seq_len + 1)
            if rank == 0:
                print(f"step {step + 1} val_loss {(vloss[0] / vloss[1]).item():.4f}", flush=True)
            model.train()

        if (step + 1) % args.save_every == 0 or step + 1 == args.max_steps:
            tag = f"step_{step + 1:07d}"
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd, "step": step + 1},
                     checkpoint_id=os.path.join(args.ckpt_dir, tag))
            dist.barrier()
            if rank == 0:
                with open(latest + ".tmp", "w") as f:
                    f.write(tag)
                os.replace(latest + ".tmp", latest)

    if rank == 0:
        print("done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
