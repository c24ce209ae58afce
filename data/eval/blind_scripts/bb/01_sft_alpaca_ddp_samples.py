#!/usr/bin/env python
"""Full-parameter SFT of a small causal LM on Alpaca-style data (torchrun + DDP).

Every `--sample_every` optimizer steps we greedy-decode a fixed set of prompts so
we can eyeball how the model is doing; completions go to output_dir/samples.jsonl.

    torchrun --nproc_per_node=8 01_sft_alpaca_ddp_samples.py --output_dir out/sft-qwen1.5b
"""
import argparse
import contextlib
import json
import math
import os
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup, set_seed

IGNORE_INDEX = -100

PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)

SAMPLE_PROMPTS = [
    "Give three tips for staying healthy.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a haiku about distributed systems.",
    "What is the capital of Australia, and why isn't it Sydney?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Convert 72 degrees Fahrenheit to Celsius and show your work.",
    "Write a SQL query that returns the five most recent orders.",
    "Suggest a name for a bakery that only sells sourdough.",
]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name_or_path", default="Qwen/Qwen2.5-1.5B")
    p.add_argument("--dataset", default="tatsu-lab/alpaca")
    p.add_argument("--output_dir", default="out/sft")
    p.add_argument("--max_len", type=int, default=1024)
    p.add_argument("--per_device_batch_size", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--warmup_ratio", type=float, default=0.03)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--eval_every", type=int, default=200)
    p.add_argument("--sample_every", type=int, default=500)
    p.add_argument("--max_new_tokens", type=int, default=160)
    p.add_argument("--val_size", type=int, default=1000)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def format_prompt(ex):
    if ex.get("input"):
        return PROMPT_WITH_INPUT.format(instruction=ex["instruction"], input=ex["input"])
    return PROMPT_NO_INPUT.format(instruction=ex["instruction"])


def tokenize_fn(ex, tokenizer, max_len):
    prompt_ids = tokenizer(format_prompt(ex), add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(ex["output"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    input_ids = (prompt_ids + answer_ids)[:max_len]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + answer_ids)[:max_len]
    return {"input_ids": input_ids, "labels": labels}


class PadCollator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, features):
        max_len = max(len(f["input_ids"]) for f in features)
        input_ids, labels, attn = [], [], []
        for f in features:
            n = len(f["input_ids"])
            pad = max_len - n
            input_ids.append(f["input_ids"] + [self.pad_id] * pad)
            labels.append(f["labels"] + [IGNORE_INDEX] * pad)
            attn.append([1] * n + [0] * pad)
        return {
            "input_ids": torch.tensor(input_ids, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
            "attention_mask": torch.tensor(attn, dtype=torch.long),
        }


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    loss_sum = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        n_tok = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
        loss_sum[0] += out.loss.float() * n_tok
        loss_sum[1] += n_tok
    dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
    model.train()
    return (loss_sum[0] / loss_sum[1].clamp(min=1)).item()


@torch.no_grad()
def sample_completions(model, tokenizer, device, max_new_tokens, rank, world_size):
    model.eval()
    outputs = []
    for instruction in SAMPLE_PROMPTS[rank::world_size]:
        prompt = PROMPT_NO_INPUT.format(instruction=instruction)
        enc = tokenizer(prompt, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            gen = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        text = tokenizer.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        outputs.append({"instruction": instruction, "completion": text.strip()})
    gathered = [None] * world_size
    dist.all_gather_object(gathered, outputs)
    model.train()
    return [o for per_rank in gathered for o in per_rank]


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    # rank 0 builds the datasets cache, everyone else reads it
    if rank != 0:
        dist.barrier()
    raw = load_dataset(args.dataset, split="train")
    raw = raw.train_test_split(test_size=args.val_size, seed=args.seed)
    tokenized = raw.map(
        tokenize_fn,
        fn_kwargs={"tokenizer": tokenizer, "max_len": args.max_len},
        remove_columns=raw["train"].column_names,
        num_proc=8,
        desc="tokenize",
    )
    if rank == 0:
        dist.barrier()

    collate = PadCollator(tokenizer.pad_token_id)
    train_sampler = DistributedSampler(tokenized["train"], shuffle=True, seed=args.seed)
    # strided shard without the sampler's padding so every val example is counted once
    val_shard = Subset(tokenized["test"], list(range(rank, len(tokenized["test"]), world_size)))
    train_loader = DataLoader(tokenized["train"], batch_size=args.per_device_batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=2, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_shard, batch_size=args.per_device_batch_size, shuffle=False,
                            collate_fn=collate, num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, torch_dtype=torch.float32)
    model.config.use_cache = False
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in n else decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=True,
    )
    steps_per_epoch = len(train_loader) // args.grad_accum
    total_steps = steps_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"world={world_size} train={len(tokenized['train'])} steps={total_steps}", flush=True)

    global_step = 0
    model.train()
    t0 = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        running = 0.0
        for micro_step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            is_sync_step = (micro_step + 1) % args.grad_accum == 0
            ctx = contextlib.nullcontext() if is_sync_step else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss / args.grad_accum
                loss.backward()
            running += loss.item()
            if not is_sync_step:
                continue

            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1

            if global_step % 10 == 0:
                stat = torch.tensor(running, device=device)
                dist.all_reduce(stat, op=dist.ReduceOp.AVG)
                if rank == 0:
                    dt = time.time() - t0
                    print(f"ep {epoch} step {global_step}/{total_steps} loss {stat.item() / 10:.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} {dt / 10:.2f}s/it", flush=True)
                running = 0.0
                t0 = time.time()

            if global_step % args.eval_every == 0:
                val_loss = evaluate(model.module, val_loader, device)
                if rank == 0:
                    print(f"step {global_step} val_loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}", flush=True)

            if global_step % args.sample_every == 0:
                samples = sample_completions(model, tokenizer, device, args.max_new_tokens, rank, world_size)
                if rank == 0:
                    with open(os.path.join(args.output_dir, "samples.jsonl"), "a") as f:
                        for s in samples:
                            f.write(json.dumps({"step": global_step, **s}) + "\n")

        if rank == 0:
            ckpt_dir = os.path.join(args.output_dir, f"epoch-{epoch}")
            model.module.save_pretrained(ckpt_dir, safe_serialization=True)
            tokenizer.save_pretrained(ckpt_dir)
        dist.barrier()

    val_loss = evaluate(model.module, val_loader, device)
    if rank == 0:
        print(f"final val_loss {val_loss:.4f}", flush=True)
        model.module.save_pretrained(os.path.join(args.output_dir, "final"), safe_serialization=True)
        tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
