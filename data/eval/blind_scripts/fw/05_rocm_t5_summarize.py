#!/usr/bin/env python
"""Fine-tune T5 for abstractive summarization (XSum) on AMD MI210s.

ROCm exposes the GPUs through torch.cuda, and the "nccl" backend is RCCL.

    HIP_VISIBLE_DEVICES=0,1,2,3 torchrun --nproc_per_node=4 05_rocm_t5_summarize.py \
        --output_dir /shared/runs/t5-base-xsum --model_name t5-base
"""
import argparse
import json
import logging
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

import evaluate
from datasets import load_dataset
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name", default="t5-base")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_source_len", type=int, default=512)
    parser.add_argument("--max_target_len", type=int, default=64)
    parser.add_argument("--per_device_batch_size", type=int, default=16)
    parser.add_argument("--learning_rate", type=float, default=3e-4)
    parser.add_argument("--num_epochs", type=int, default=3)
    parser.add_argument("--warmup_steps", type=int, default=500)
    parser.add_argument("--eval_samples", type=int, default=2000)
    parser.add_argument("--num_beams", type=int, default=4)
    parser.add_argument("--seed", type=int, default=17)
    return parser.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def preprocess_fn(tokenizer, args):
    def _fn(batch):
        inputs = ["summarize: " + doc for doc in batch["document"]]
        model_inputs = tokenizer(inputs, max_length=args.max_source_len, truncation=True)
        labels = tokenizer(text_target=batch["summary"], max_length=args.max_target_len, truncation=True)
        model_inputs["labels"] = labels["input_ids"]
        return model_inputs
    return _fn


def run_generation_eval(model, tokenizer, loader, device, args, rouge):
    model.eval()
    preds, refs = [], []
    with torch.no_grad():
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            generated = model.generate(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                max_new_tokens=args.max_target_len,
                num_beams=args.num_beams,
            )
            labels = batch["labels"].masked_fill(batch["labels"] == -100, tokenizer.pad_token_id)
            preds += tokenizer.batch_decode(generated, skip_special_tokens=True)
            refs += tokenizer.batch_decode(labels, skip_special_tokens=True)
    model.train()

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (preds, refs))
    if dist.get_rank() != 0:
        return None
    all_preds = [p for part in gathered for p in part[0]]
    all_refs = [r for part in gathered for r in part[1]]
    scores = rouge.compute(predictions=all_preds, references=all_refs, use_stemmer=True)
    return {k: round(v * 100, 2) for k, v in scores.items()}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARN)
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    # the first rank populates the datasets cache; the rest read it afterwards
    if rank != 0:
        dist.barrier()
    raw = load_dataset("EdinburghNLP/xsum")
    tokenized = raw.map(preprocess_fn(tokenizer, args), batched=True,
                        remove_columns=raw["train"].column_names, num_proc=8)
    if rank == 0:
        dist.barrier()

    train_ds = tokenized["train"]
    eval_ds = tokenized["validation"].select(range(args.eval_samples))
    eval_shard = Subset(eval_ds, range(rank, len(eval_ds), world_size))

    model = AutoModelForSeq2SeqLM.from_pretrained(args.model_name).to(device)
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100, pad_to_multiple_of=8)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.per_device_batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=4, pin_memory=True)
    eval_loader = DataLoader(eval_shard, batch_size=args.per_device_batch_size, shuffle=False,
                             collate_fn=collator, num_workers=2)

    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    total_steps = len(train_loader) * args.num_epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, total_steps)
    rouge = evaluate.load("rouge")

    logger.info("train examples %d, steps/epoch %d, world size %d", len(train_ds), len(train_loader), world_size)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    step = 0
    best_rouge2 = -math.inf
    for epoch in range(args.num_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 100 == 0:
                reduced = loss.detach()
                dist.all_reduce(reduced, op=dist.ReduceOp.AVG)
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, total_steps, reduced.item())

        scores = run_generation_eval(model, tokenizer, eval_loader, device, args, rouge)
        if rank == 0:
            logger.info("epoch %d rouge: %s", epoch, scores)
            with open(os.path.join(args.output_dir, "eval_results.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "step": step, **scores}) + "\n")
            if scores["rouge2"] > best_rouge2:
                best_rouge2 = scores["rouge2"]
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))
        dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.output_dir, "final"))
        tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
