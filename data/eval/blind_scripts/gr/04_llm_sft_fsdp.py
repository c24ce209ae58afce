#!/usr/bin/env python
# Supervised fine-tuning of a small causal LM on an instruction JSONL file with FSDP.
#
# Single-GPU version ran out of memory with full fine-tuning of the 1.5B model on a 24GB card,
# so this shards params/grads/optimizer state with FSDP (FULL_SHARD).
#
# Usage:
#   torchrun --nproc_per_node=8 04_llm_sft_fsdp.py \
#       --model Qwen/Qwen2.5-1.5B --train-file data/sft_train.jsonl --eval-file data/sft_eval.jsonl
import argparse
import functools
import json
import math
import os
import random

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
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

IGNORE_INDEX = -100
PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-1.5B")
    ap.add_argument("--train-file", required=True)
    ap.add_argument("--eval-file", required=True)
    ap.add_argument("--output-dir", default="outputs/sft")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--per-device-batch", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup-ratio", type=float, default=0.03)
    ap.add_argument("--save-every-epoch", action="store_true")
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def setup_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    return local_rank


def cleanup():
    dist.destroy_process_group()


def is_main_process():
    return dist.get_rank() == 0


def log(msg):
    if is_main_process():
        print(msg, flush=True)


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class SFTDataset(Dataset):
    def __init__(self, path, tokenizer, max_len):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f if line.strip()]
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        prompt = PROMPT_TEMPLATE.format(instruction=row["instruction"])
        prompt_ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = self.tok(row["output"], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        input_ids = (prompt_ids + answer_ids)[: self.max_len]
        labels = ([IGNORE_INDEX] * len(prompt_ids) + answer_ids)[: self.max_len]
        return {"input_ids": input_ids, "labels": labels}


def collate(batch, pad_id):
    max_len = max(len(b["input_ids"]) for b in batch)
    input_ids = torch.full((len(batch), max_len), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), max_len), IGNORE_INDEX, dtype=torch.long)
    attn = torch.zeros((len(batch), max_len), dtype=torch.long)
    for i, b in enumerate(batch):
        n = len(b["input_ids"])
        input_ids[i, :n] = torch.tensor(b["input_ids"])
        labels[i, :n] = torch.tensor(b["labels"])
        attn[i, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attn}


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    totals = torch.zeros(2, device=device)  # sum of token losses, number of tokens
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        n_tok = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
        totals[0] += out.loss.float() * n_tok
        totals[1] += n_tok
    dist.all_reduce(totals)
    model.train()
    mean_loss = (totals[0] / totals[1]).item()
    return mean_loss, math.exp(min(mean_loss, 20))


def save_hf_checkpoint(model, tokenizer, out_dir):
    if is_main_process():
        os.makedirs(out_dir, exist_ok=True)
        save_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_cfg):
            cpu_state = model.state_dict()
        model.module.save_pretrained(out_dir, state_dict=cpu_state, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        print(f"saved model to {out_dir}", flush=True)
    dist.barrier()


def main():
    args = parse_args()
    local_rank = setup_distributed()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_everything(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token

    train_ds = SFTDataset(args.train_file, tokenizer, args.max_len)
    eval_ds = SFTDataset(args.eval_file, tokenizer, args.max_len)
    collate_fn = functools.partial(collate, pad_id=tokenizer.pad_token_id)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    # drop_last so that every rank runs the same number of eval forwards under FSDP
    eval_sampler = DistributedSampler(eval_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.per_device_batch, sampler=train_sampler,
                              collate_fn=collate_fn, num_workers=4, pin_memory=True, drop_last=True)
    eval_loader = DataLoader(eval_ds, batch_size=args.per_device_batch, sampler=eval_sampler,
                             collate_fn=collate_fn, num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32,
                                                 low_cpu_mem_usage=True)
    model.config.use_cache = False

    wrap_policy = functools.partial(transformer_auto_wrap_policy,
                                    transformer_layer_cls={Qwen2DecoderLayer})
    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        device_id=local_rank,
        use_orig_params=True,
    )
    log(model)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    updates_per_epoch = len(train_loader) // args.grad_accum
    total_updates = updates_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_updates), total_updates)
    log(f"world={world_size} global batch={args.per_device_batch * args.grad_accum * world_size} "
        f"updates={total_updates}")

    global_step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        pbar = tqdm(total=updates_per_epoch, disable=not is_main_process(), desc=f"epoch {epoch}")
        for i, batch in enumerate(train_loader):
            if i >= updates_per_epoch * args.grad_accum:
                break
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss / args.grad_accum
            loss.backward()

            if (i + 1) % args.grad_accum == 0:
                model.clip_grad_norm_(1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                global_step += 1
                pbar.update(1)
                if global_step % 10 == 0:
                    reduced = loss.detach() * args.grad_accum
                    dist.all_reduce(reduced, op=dist.ReduceOp.AVG)
                    pbar.set_postfix(loss=f"{reduced.item():.4f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
        pbar.close()

        eval_loss, ppl = evaluate(model, eval_loader, device)
        log(f"epoch {epoch}: eval_loss={eval_loss:.4f} ppl={ppl:.2f}")
        if args.save_every_epoch:
            save_hf_checkpoint(model, tokenizer, os.path.join(args.output_dir, f"epoch_{epoch}"))

    save_hf_checkpoint(model, tokenizer, os.path.join(args.output_dir, "final"))
    cleanup()


if __name__ == "__main__":
    main()
