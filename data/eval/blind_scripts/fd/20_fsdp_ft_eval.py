#!/usr/bin/env python
"""Domain-adaptive continued pretraining with FSDP, with held-out perplexity eval
before and after, and a consolidated checkpoint at the end.

    torchrun --nproc_per_node=8 20_fsdp_ft_eval.py --model meta-llama/Llama-2-7b-hf \
        --train_dir data/pubmed_tok/train --eval_dir data/pubmed_tok/val --out runs/llama7b_pubmed
"""
import argparse
import functools
import glob
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import (
    FullStateDictConfig,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--train_dir", required=True, help="directory of uint16 .npy token shards")
    ap.add_argument("--eval_dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--micro_bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--max_steps", type=int, default=2000)
    ap.add_argument("--eval_every", type=int, default=500)
    ap.add_argument("--eval_batches", type=int, default=50)
    return ap.parse_args()


class PackedTokens(Dataset):
    """Fixed-length windows over concatenated pre-tokenized shards."""

    def __init__(self, directory, seq_len):
        arrays = [np.load(p, mmap_mode="r") for p in sorted(glob.glob(os.path.join(directory, "*.npy")))]
        self.tokens = np.concatenate(arrays)
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i):
        s = i * self.seq_len
        chunk = torch.from_numpy(self.tokens[s : s + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


@torch.no_grad()
def evaluate(model, loader, device, max_batches):
    model.eval()
    stats = torch.zeros(2, device=device, dtype=torch.float64)
    for i, (x, y) in enumerate(loader):
        if i >= max_batches:
            break
        x, y = x.to(device), y.to(device)
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().view(-1, logits.size(-1)), y.view(-1), reduction="sum"
        )
        stats[0] += loss
        stats[1] += y.numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    wrap_policy = functools.partial(transformer_auto_wrap_policy,
                                    transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        device_id=torch.cuda.current_device(),
        limit_all_gathers=True,
        use_orig_params=True,
    )

    train_ds = PackedTokens(args.train_dir, args.seq_len)
    eval_ds = PackedTokens(args.eval_dir, args.seq_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    eval_sampler = DistributedSampler(eval_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.micro_bs, sampler=train_sampler,
                              num_workers=2, pin_memory=True, drop_last=True)
    eval_loader = DataLoader(eval_ds, batch_size=args.micro_bs, sampler=eval_sampler, num_workers=2)

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = get_cosine_schedule_with_warmup(optim, args.warmup, args.max_steps)

    history = []
    base_loss = evaluate(model, eval_loader, device, args.eval_batches)
    history.append({"step": 0, "eval_loss": base_loss, "eval_ppl": math.exp(base_loss)})
    if rank == 0:
        print(f"before training: eval loss {base_loss:.4f} ppl {math.exp(base_loss):.2f}", flush=True)

    step, epoch = 0, 0
    t0 = time.time()
    model.train()
    while step < args.max_steps:
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
            loss.backward()
            model.clip_grad_norm_(1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 20 == 0:
                tps = step * args.micro_bs * args.seq_len * world / (time.time() - t0)
                print(f"step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{tps:,.0f} tok/s", flush=True)
            if step % args.eval_every == 0 or step == args.max_steps:
                ev = evaluate(model, eval_loader, device, args.eval_batches)
                history.append({"step": step, "eval_loss": ev, "eval_ppl": math.exp(ev)})
                if rank == 0:
                    print(f"step {step}: eval loss {ev:.4f} ppl {math.exp(ev):.2f}", flush=True)
            if step >= args.max_steps:
                break
        epoch += 1

    os.makedirs(args.out, exist_ok=True)
    if rank == 0:
        save_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_cfg):
            cpu_state = model.state_dict()
        torch.save(cpu_state, os.path.join(args.out, "consolidated.pt"))
        with open(os.path.join(args.out, "eval_history.json"), "w") as f:
            json.dump(history, f, indent=2)
        print(f"saved consolidated weights to {args.out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
