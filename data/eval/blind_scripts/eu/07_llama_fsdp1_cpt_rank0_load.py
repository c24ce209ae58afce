#!/usr/bin/env python
"""Continued pretraining of Llama-2-7B on domain text with FSDP1.

Memory plan:
  * rank 0 loads the HF checkpoint on CPU (fp32), every other rank builds the
    model on the meta device; FSDP broadcasts rank 0's weights while sharding
  * resumable checkpoints are sharded DCP directories
  * the final HF export gathers a full state dict onto rank 0's CPU

Launch (2 nodes x 8 GPUs, via the cluster's wrapper around torchrun):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=${MASTER_ADDR}:29500 \
        07_llama_fsdp1_cpt_rank0_load.py --data /shared/corpora/legal_tok
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
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import (
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="meta-llama/Llama-2-7b-hf")
    ap.add_argument("--data", required=True, help="dir with train.bin / val.bin (uint16 llama tokens)")
    ap.add_argument("--out", default="/shared/ckpt/llama2-7b-legal")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--accum", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--steps", type=int, default=8000)
    ap.add_argument("--save-every", type=int, default=500)
    ap.add_argument("--eval-every", type=int, default=250)
    return ap.parse_args()


class Packed(Dataset):
    def __init__(self, path, seq):
        self.d = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq = seq

    def __len__(self):
        return (len(self.d) - 1) // self.seq

    def __getitem__(self, i):
        x = torch.from_numpy(self.d[i * self.seq:(i + 1) * self.seq + 1].astype(np.int64))
        return x[:-1], x[1:]


def build(args, rank):
    if rank == 0:
        model = AutoModelForCausalLM.from_pretrained(args.base, torch_dtype=torch.float32,
                                                     low_cpu_mem_usage=True, attn_implementation="sdpa")
    else:
        cfg = AutoConfig.from_pretrained(args.base)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    return model


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * 0.5 * (1 + math.cos(math.pi * (step - args.warmup) / (args.steps - args.warmup)))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    model = build(args, rank)
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.float32),
        device_id=dev,
        sync_module_states=True,
        param_init_fn=(lambda m: m.to_empty(device=dev, recurse=False)) if rank != 0 else None,
        use_orig_params=True,
        limit_all_gathers=True,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
    )
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    train = Packed(os.path.join(args.data, "train.bin"), args.seq)
    val = Packed(os.path.join(args.data, "val.bin"), args.seq)
    sampler = DistributedSampler(train, shuffle=True, seed=1234, drop_last=True)
    loader = DataLoader(train, batch_size=args.mbs, sampler=sampler, num_workers=4, pin_memory=True,
                        drop_last=True)
    val_loader = DataLoader(val, batch_size=args.mbs, sampler=DistributedSampler(val, shuffle=False, drop_last=True),
                            num_workers=2)

    step = 0
    state_file = os.path.join(args.out, "last_step.json")
    if os.path.exists(state_file):
        with open(state_file) as f:
            step = json.load(f)["step"]
        msd, osd = get_state_dict(model, optim)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=os.path.join(args.out, f"dcp_{step:06d}"))
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        if rank == 0:
            print(f"resumed from step {step}", flush=True)

    def evaluate(max_batches=40):
        model.eval()
        s = torch.zeros(2, device=dev)
        with torch.no_grad():
            for i, (x, y) in enumerate(val_loader):
                if i == max_batches:
                    break
                logits = model(input_ids=x.to(dev)).logits
                s[0] += torch.nn.functional.cross_entropy(
                    logits.float().view(-1, logits.size(-1)), y.to(dev).view(-1), reduction="sum")
                s[1] += y.numel()
        dist.all_reduce(s)
        model.train()
        return (s[0] / s[1]).item()

    epoch = (step * args.accum) // len(loader)
    sampler.set_epoch(epoch)
    it = iter(loader)
    for _ in range((step * args.accum) % len(loader)):
        next(it)

    model.train()
    tic = time.time()
    while step < args.steps:
        for g in optim.param_groups:
            g["lr"] = lr_at(step, args)
        tot = torch.zeros((), device=dev)
        for micro in range(args.accum):
            try:
                x, y = next(it)
            except StopIteration:
                epoch += 1
                sampler.set_epoch(epoch)
                it = iter(loader)
                x, y = next(it)
            with model.no_sync() if micro < args.accum - 1 else torch.enable_grad():
                logits = model(input_ids=x.to(dev, non_blocking=True)).logits
                loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)),
                                                         y.to(dev, non_blocking=True).view(-1))
                (loss / args.accum).backward()
            tot += loss.detach() / args.accum
        gn = model.clip_grad_norm_(1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        step += 1

        if step % 10 == 0:
            dist.all_reduce(tot, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step} loss {tot.item():.4f} gnorm {gn.item():.3f} "
                      f"lr {lr_at(step, args):.2e} {(time.time() - tic) / 10:.2f}s/step", flush=True)
            tic = time.time()
        if step % args.eval_every == 0:
            vl = evaluate()
            if rank == 0:
                print(f"step {step} val_loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
        if step % args.save_every == 0:
            msd, osd = get_state_dict(model, optim)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(args.out, f"dcp_{step:06d}"))
            if rank == 0:
                with open(state_file, "w") as f:
                    json.dump({"step": step}, f)

    # HF export: every rank takes part in the all-gather, only rank 0 ends up with tensors
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        full_sd = model.state_dict()
    if rank == 0:
        export_dir = os.path.join(args.out, "hf_final")
        model.module.save_pretrained(export_dir, state_dict=full_sd, safe_serialization=True)
        AutoTokenizer.from_pretrained(args.base).save_pretrained(export_dir)
        print(f"exported to {export_dir}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
