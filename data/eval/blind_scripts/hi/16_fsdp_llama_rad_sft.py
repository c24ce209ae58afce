#!/usr/bin/env python
# Supervised fine-tuning of Llama-2-7B on radiology instruction data (report QA, impression
# writing, lay-language rewrites) with FSDP full sharding.
#
#   torchrun --nproc_per_node=8 16_fsdp_llama_rad_sft.py --data data/rad_instruct.jsonl \
#       --output_dir /nfs/ckpt/llama2-rad-sft
import argparse
import functools
import json
import os
import random
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import (BackwardPrefetch, FullStateDictConfig, FullyShardedDataParallel as FSDP,
                                    MixedPrecision, ShardingStrategy, StateDictType)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import LlamaForCausalLM, LlamaTokenizer, get_cosine_schedule_with_warmup
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

TEMPLATE = ("Below is an instruction about a radiology report. Write a response that completes the request.\n\n"
            "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
IGNORE = -100


class InstructData(Dataset):
    def __init__(self, rows, tokenizer, max_len):
        self.rows = rows
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        prompt = TEMPLATE.format(instruction=r["instruction"], input=r.get("input", ""))
        p_ids = self.tok(prompt, add_special_tokens=False).input_ids
        a_ids = self.tok(r["output"], add_special_tokens=False).input_ids
        ids = [self.tok.bos_token_id] + p_ids + a_ids + [self.tok.eos_token_id]
        labels = [IGNORE] * (1 + len(p_ids)) + a_ids + [self.tok.eos_token_id]
        return torch.tensor(ids[:self.max_len]), torch.tensor(labels[:self.max_len])


def pad_collate(batch, pad_id):
    ids, labels = zip(*batch)
    ids = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=pad_id)
    labels = torch.nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value=IGNORE)
    return ids, labels, ids.ne(pad_id).long()


def read_rows(path, val_size, seed):
    with open(path) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    rng = random.Random(seed)
    rng.shuffle(rows)
    return rows[val_size:], rows[:val_size]


def save_model(model, tokenizer, out_dir, rank):
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        torch.save(state, os.path.join(out_dir, "consolidated.pt"))
        tokenizer.save_pretrained(out_dir)
        print(f"saved {out_dir}", flush=True)
    dist.barrier()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name", default="meta-llama/Llama-2-7b-hf")
    parser.add_argument("--data", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_len", type=int, default=1024)
    parser.add_argument("--micro_batch", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--val_size", type=int, default=500)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)

    tokenizer = LlamaTokenizer.from_pretrained(args.model_name)
    tokenizer.pad_token = tokenizer.unk_token
    train_rows, val_rows = read_rows(args.data, args.val_size, args.seed)
    train_ds = InstructData(train_rows, tokenizer, args.max_len)
    val_ds = InstructData(val_rows, tokenizer, args.max_len)
    collate = functools.partial(pad_collate, pad_id=tokenizer.pad_token_id)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.micro_batch, sampler=train_sampler, collate_fn=collate,
                          num_workers=2, pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=args.micro_batch, sampler=DistributedSampler(val_ds, shuffle=False),
                        collate_fn=collate, num_workers=2)

    model = LlamaForCausalLM.from_pretrained(args.model_name, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    auto_wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(
        model,
        auto_wrap_policy=auto_wrap,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        device_id=torch.cuda.current_device(),
        use_orig_params=False,
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total_steps = len(train_dl) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.03 * total_steps), total_steps)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (ids, labels, attn) in enumerate(train_dl):
            ids, labels, attn = ids.cuda(), labels.cuda(), attn.cuda()
            loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if rank == 0 and step % 10 == 0:
                print(f"[epoch {epoch}] step {step}/{len(train_dl)} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} elapsed {time.time() - t0:.0f}s", flush=True)

        model.eval()
        agg = torch.zeros(2, device=torch.cuda.current_device())
        with torch.no_grad():
            for ids, labels, attn in val_dl:
                out = model(input_ids=ids.cuda(), attention_mask=attn.cuda(), labels=labels.cuda())
                agg[0] += out.loss.float()
                agg[1] += 1
        dist.all_reduce(agg)
        if rank == 0:
            print(f"epoch {epoch} val loss {(agg[0] / agg[1]).item():.4f}", flush=True)

        save_model(model, tokenizer, os.path.join(args.output_dir, f"epoch_{epoch}"), rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
