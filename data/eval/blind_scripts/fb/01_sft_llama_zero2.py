#!/usr/bin/env python
"""Supervised fine-tuning of a causal LM on instruction data with DeepSpeed ZeRO-2.

Launch:
    deepspeed --num_gpus 8 sft_llama_zero2.py \
        --deepspeed --deepspeed_config configs/zero2_bf16.json \
        --model_name_or_path meta-llama/Llama-2-7b-hf \
        --train_file data/sft_train.jsonl --eval_file data/sft_eval.jsonl
"""
import argparse
import json
import logging
import math
import os
import time

import deepspeed
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

logger = logging.getLogger("sft")

PROMPT_TEMPLATE = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
IGNORE_INDEX = -100


def parse_args():
    parser = argparse.ArgumentParser(description="SFT with DeepSpeed")
    parser.add_argument("--model_name_or_path", type=str, required=True)
    parser.add_argument("--train_file", type=str, required=True)
    parser.add_argument("--eval_file", type=str, default=None)
    parser.add_argument("--max_seq_len", type=int, default=1024)
    parser.add_argument("--num_epochs", type=int, default=3)
    parser.add_argument("--output_dir", type=str, default="outputs/sft")
    parser.add_argument("--save_every", type=int, default=500)
    parser.add_argument("--log_every", type=int, default=10)
    parser.add_argument("--num_workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class InstructionDataset(Dataset):
    def __init__(self, path, tokenizer, max_len):
        self.examples = []
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    self.examples.append(json.loads(line))
        self.tokenizer = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, idx):
        ex = self.examples[idx]
        prompt = PROMPT_TEMPLATE.format(instruction=ex["instruction"])
        if ex.get("input"):
            prompt = prompt.replace("### Response:", f"### Input:\n{ex['input']}\n\n### Response:")
        prompt_ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        answer_ids = self.tokenizer(ex["output"], add_special_tokens=False)["input_ids"]
        answer_ids = answer_ids + [self.tokenizer.eos_token_id]
        input_ids = (prompt_ids + answer_ids)[: self.max_len]
        labels = ([IGNORE_INDEX] * len(prompt_ids) + answer_ids)[: self.max_len]
        return {"input_ids": input_ids, "labels": labels}


class Collator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        max_len = max(len(b["input_ids"]) for b in batch)
        input_ids, labels, attn = [], [], []
        for b in batch:
            n = len(b["input_ids"])
            pad = max_len - n
            input_ids.append(b["input_ids"] + [self.pad_id] * pad)
            labels.append(b["labels"] + [IGNORE_INDEX] * pad)
            attn.append([1] * n + [0] * pad)
        return {
            "input_ids": torch.tensor(input_ids, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
            "attention_mask": torch.tensor(attn, dtype=torch.long),
        }


def make_loader(dataset, batch_size, collate_fn, num_workers, shuffle):
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        collate_fn=collate_fn,
        num_workers=num_workers,
        pin_memory=True,
        drop_last=shuffle,
    )


@torch.no_grad()
def evaluate(engine, loader):
    engine.eval()
    total_loss = torch.zeros(1, device=engine.device)
    total_tokens = torch.zeros(1, device=engine.device)
    for batch in loader:
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        out = engine(**batch)
        n_tok = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
        total_loss += out.loss.float() * n_tok
        total_tokens += n_tok
    engine.train()
    loss = (total_loss / total_tokens.clamp(min=1)).item()
    return loss, math.exp(min(loss, 20))


def main():
    args = parse_args()
    deepspeed.init_distributed()
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(message)s",
    )
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, use_fast=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, torch_dtype=torch.bfloat16)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False

    params = [p for p in model.parameters() if p.requires_grad]
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(args=args, model=model, model_parameters=params)

    collator = Collator(tokenizer.pad_token_id)
    train_ds = InstructionDataset(args.train_file, tokenizer, args.max_seq_len)
    train_loader = make_loader(
        train_ds, engine.train_micro_batch_size_per_gpu(), collator, args.num_workers, shuffle=True
    )
    eval_loader = None
    if args.eval_file:
        eval_ds = InstructionDataset(args.eval_file, tokenizer, args.max_seq_len)
        eval_loader = make_loader(
            eval_ds, engine.train_micro_batch_size_per_gpu(), collator, args.num_workers, shuffle=False
        )

    logger.info(
        "world_size=%d train_examples=%d micro_bs=%d grad_accum=%d global_bs=%d",
        world_size, len(train_ds), engine.train_micro_batch_size_per_gpu(),
        engine.gradient_accumulation_steps(), engine.train_batch_size(),
    )

    # resume if a checkpoint is present
    start_epoch = 0
    if os.path.isdir(args.output_dir) and os.path.exists(os.path.join(args.output_dir, "latest")):
        load_path, client_state = engine.load_checkpoint(args.output_dir)
        if load_path is not None:
            start_epoch = client_state.get("epoch", 0)
            logger.info("resumed from %s at epoch %d", load_path, start_epoch)

    engine.train()
    for epoch in range(start_epoch, args.num_epochs):
        t0 = time.time()
        running = 0.0
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
            outputs = engine(**batch)
            loss = outputs.loss
            engine.backward(loss)
            engine.step()
            running += loss.item()

            if engine.is_gradient_accumulation_boundary():
                gstep = engine.global_steps
                if gstep % args.log_every == 0:
                    logger.info(
                        "epoch %d step %d loss %.4f lr %.3e (%.1fs)",
                        epoch, gstep, running / (step + 1), engine.get_lr()[0], time.time() - t0,
                    )
                if gstep % args.save_every == 0:
                    engine.save_checkpoint(args.output_dir, tag=f"step{gstep}", client_state={"epoch": epoch})

        if eval_loader is not None:
            eval_loss, ppl = evaluate(engine, eval_loader)
            logger.info("epoch %d eval_loss %.4f ppl %.2f", epoch, eval_loss, ppl)

        engine.save_checkpoint(args.output_dir, tag=f"epoch{epoch}", client_state={"epoch": epoch + 1})

    engine.save_16bit_model(os.path.join(args.output_dir, "final"))
    if rank == 0:
        tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))
        model.config.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
