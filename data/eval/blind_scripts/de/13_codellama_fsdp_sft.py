#!/usr/bin/env python
"""Code-instruction SFT for CodeLlama-7B, FSDP full shard, with periodic validation.

    torchrun --nproc_per_node=8 13_codellama_fsdp_sft.py --train data/code_instruct_train.jsonl \
        --valid data/code_instruct_valid.jsonl --out checkpoints/codellama-7b-instruct
"""
import argparse
import functools
import json
import math
import os
from datetime import datetime

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

PROMPT = "[INST] {instruction}\n{context}[/INST]"


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="codellama/CodeLlama-7b-hf")
    p.add_argument("--train", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--out", default="checkpoints/codellama-7b-instruct")
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--bs", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--valid_every", type=int, default=250)
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args()


class InstructionData(Dataset):
    def __init__(self, path, tok, max_len):
        self.rows = []
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                ctx = f"\n```\n{r['input']}\n```\n" if r.get("input") else ""
                prompt = PROMPT.format(instruction=r["instruction"].strip(), context=ctx)
                p_ids = tok(prompt, add_special_tokens=True).input_ids
                a_ids = tok(" " + r["output"].strip(), add_special_tokens=False).input_ids + [tok.eos_token_id]
                ids = (p_ids + a_ids)[:max_len]
                lab = ([-100] * len(p_ids) + a_ids)[:max_len]
                if len(p_ids) < max_len:
                    self.rows.append((ids, lab))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def collate(batch, pad_id):
    T = max(len(x) for x, _ in batch)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    lab = torch.full((len(batch), T), -100, dtype=torch.long)
    att = torch.zeros((len(batch), T), dtype=torch.long)
    for i, (x, y) in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
        lab[i, : len(y)] = torch.tensor(y)
        att[i, : len(x)] = 1
    return {"input_ids": ids, "labels": lab, "attention_mask": att}


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    total, count = 0.0, 0
    for batch in loader:
        batch = {k: v.cuda() for k, v in batch.items()}
        out = model(**batch)
        n = int((batch["labels"][:, 1:] != -100).sum())
        total += out.loss.item() * n
        count += n
    model.train()
    return total / max(count, 1)


def save(model, tok, path, rank):
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        sd = model.state_dict()
    if rank == 0:
        model.module.save_pretrained(path, state_dict=sd)
        tok.save_pretrained(path)
        print(f"{datetime.now():%H:%M:%S} saved -> {path}", flush=True)
    dist.barrier()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.eos_token
    train_ds = InstructionData(args.train, tok, args.max_len)
    valid_ds = InstructionData(args.valid, tok, args.max_len)
    coll = functools.partial(collate, pad_id=tok.pad_token_id)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=coll, num_workers=4,
                          pin_memory=True)
    valid_dl = DataLoader(valid_ds, batch_size=args.bs, shuffle=False, collate_fn=coll, num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        device_id=torch.cuda.current_device(),
    )

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    total_steps = args.epochs * len(train_dl) // args.grad_accum
    sched = get_cosine_schedule_with_warmup(opt, int(0.03 * total_steps), total_steps)
    if rank == 0:
        print(f"train {len(train_ds)} valid {len(valid_ds)} steps {total_steps}", flush=True)

    step, best = 0, float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for i, batch in enumerate(train_dl):
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss / args.grad_accum
            loss.backward()
            if (i + 1) % args.grad_accum:
                continue
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 20 == 0:
                rep = loss.detach() * args.grad_accum
                dist.all_reduce(rep, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"{datetime.now():%H:%M:%S} ep{epoch} step {step}/{total_steps} "
                          f"loss {rep.item():.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)

            if step % args.valid_every == 0:
                # the validation set is small, one process is enough
                if rank == 0:
                    vl = evaluate(model, valid_dl)
                    print(f"[valid] step {step} loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
                dist.barrier()

        save(model, tok, os.path.join(args.out, f"epoch{epoch}"), rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
