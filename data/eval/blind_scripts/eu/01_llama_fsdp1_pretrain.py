#!/usr/bin/env python3
"""Llama-style pretraining with FSDP (v1) on pre-tokenized uint16 shards.

Owned by the training-infra team. Model size is picked with --model
(see MODEL_CONFIGS); data is the usual train.bin / val.bin memmap layout.
"""
import argparse
import functools
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.fsdp import BackwardPrefetch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

MODEL_CONFIGS = {
    "410m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=26, num_attention_heads=24,
               num_key_value_heads=8),
}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="/mnt/shared/datasets/slimpajama-6b-llama")
    p.add_argument("--out-dir", default="/mnt/shared/runs/llama-fsdp")
    p.add_argument("--model", default="1b", choices=sorted(MODEL_CONFIGS))
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--min-lr", type=float, default=3e-5)
    p.add_argument("--warmup-steps", type=int, default=2000)
    p.add_argument("--max-steps", type=int, default=60000)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--eval-batches", type=int, default=50)
    p.add_argument("--ckpt-every", type=int, default=2000)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--no-act-ckpt", action="store_true")
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args()


class MemmapTokens(Dataset):
    def __init__(self, path, seq_len):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, idx):
        start = idx * self.seq_len
        chunk = torch.from_numpy(self.data[start:start + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


def lr_at(step, args):
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1.0 + math.cos(math.pi * progress))


def build_model(args):
    cfg = LlamaConfig(
        vocab_size=32000,
        max_position_embeddings=args.seq_len,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        **MODEL_CONFIGS[args.model],
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(cfg)


def save_checkpoint(model, optimizer, step, args, rank):
    path = os.path.join(args.out_dir, f"step_{step:07d}")
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}
        dcp.save(state, checkpoint_id=path)
    if rank == 0:
        with open(os.path.join(path, "trainer_state.json"), "w") as f:
            json.dump({"step": step}, f)
        with open(os.path.join(args.out_dir, "latest"), "w") as f:
            f.write(os.path.basename(path))
    dist.barrier()


def maybe_resume(model, optimizer, args):
    latest = os.path.join(args.out_dir, "latest")
    if not os.path.exists(latest):
        return 0
    with open(latest) as f:
        path = os.path.join(args.out_dir, f.read().strip())
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        optim_state = load_sharded_optimizer_state_dict(
            model_state_dict=state["model"],
            optimizer_key="optim",
            storage_reader=dcp.FileSystemReader(path),
        )
        flat_osd = FSDP.optim_state_dict_to_load(model, optimizer, optim_state["optim"])
        optimizer.load_state_dict(flat_osd)
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)["step"]


@torch.no_grad()
def evaluate(model, loader, device, max_batches):
    model.eval()
    totals = torch.zeros(2, device=device)
    for i, (x, y) in enumerate(loader):
        if i >= max_batches:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1), reduction="sum")
        totals[0] += loss
        totals[1] += y.numel()
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"world_size={world_size} tokens/step="
              f"{args.micro_batch * args.seq_len * args.grad_accum * world_size}")

    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())

    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    mp_policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        mixed_precision=mp_policy,
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        device_id=device,
        sync_module_states=True,
        limit_all_gathers=True,
    )
    if not args.no_act_ckpt:
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
        )

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True,
    )
    start_step = maybe_resume(model, optimizer, args)

    fsdp_model = model
    if args.compile:
        model = torch.compile(model)

    train_ds = MemmapTokens(os.path.join(args.data_dir, "train.bin"), args.seq_len)
    val_ds = MemmapTokens(os.path.join(args.data_dir, "val.bin"), args.seq_len)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True,
                                       seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.micro_batch, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.micro_batch, sampler=val_sampler,
                            num_workers=args.num_workers, pin_memory=True)

    if rank == 0:
        print(f"model={args.model} params={n_params / 1e6:.1f}M start_step={start_step}")

    steps_per_epoch = len(train_loader) // args.grad_accum
    epoch = start_step // steps_per_epoch
    train_sampler.set_epoch(epoch)
    data_iter = iter(train_loader)
    # fast-forward within the epoch on resume
    for _ in range((start_step % steps_per_epoch) * args.grad_accum):
        next(data_iter)

    model.train()
    t0 = time.time()
    for step in range(start_step, args.max_steps):
        lr = lr_at(step, args)
        for g in optimizer.param_groups:
            g["lr"] = lr

        loss_acc = torch.zeros((), device=device)
        for micro in range(args.grad_accum):
            try:
                x, y = next(data_iter)
            except StopIteration:
                epoch += 1
                train_sampler.set_epoch(epoch)
                data_iter = iter(train_loader)
                x, y = next(data_iter)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
            (loss / args.grad_accum).backward()
            loss_acc += loss.detach() / args.grad_accum

        grad_norm = fsdp_model.clip_grad_norm_(args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if step % args.log_every == 0:
            dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)
            if rank == 0:
                dt = (time.time() - t0) / args.log_every
                tok_s = args.micro_batch * args.seq_len * args.grad_accum * world_size / dt
                print(f"step {step:6d} loss {loss_acc.item():.4f} lr {lr:.2e} "
                      f"gnorm {grad_norm.item():.3f} {tok_s / 1e3:.1f}k tok/s")
            t0 = time.time()

        if step > 0 and step % args.eval_every == 0:
            val_loss = evaluate(model, val_loader, device, args.eval_batches)
            if rank == 0:
                print(f"step {step:6d} val_loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}")

        if step > 0 and step % args.ckpt_every == 0:
            save_checkpoint(fsdp_model, optimizer, step, args, rank)

    save_checkpoint(fsdp_model, optimizer, args.max_steps, args, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
