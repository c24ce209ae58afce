#!/usr/bin/env python
"""
LoRA chat fine-tuning with Hugging Face Accelerate (custom loop, no Trainer).

    accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 19_accelerate_lora_chat.py \
        --model mistralai/Mistral-7B-v0.1 --dataset HuggingFaceH4/ultrachat_200k
"""
import argparse
import math
import os

import torch
from accelerate import Accelerator, PartialState
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import load_dataset
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

logger = get_logger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="mistralai/Mistral-7B-v0.1")
    p.add_argument("--dataset", default="HuggingFaceH4/ultrachat_200k")
    p.add_argument("--output_dir", default="out/mistral-lora-chat")
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--per_device_batch_size", type=int, default=2)
    p.add_argument("--global_batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--warmup_steps", type=int, default=100)
    p.add_argument("--eval_steps", type=int, default=500)
    p.add_argument("--max_eval_samples", type=int, default=2000)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--report_to", default="tensorboard")
    return p.parse_args()


def main():
    args = parse_args()
    state = PartialState()
    per_step = args.per_device_batch_size * state.num_processes
    assert args.global_batch_size % per_step == 0
    accum = args.global_batch_size // per_step
    accelerator = Accelerator(gradient_accumulation_steps=accum, log_with=args.report_to,
                              project_dir=args.output_dir)
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        tokenizer.chat_template = (
            "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + eos_token + '\n' }}{% endfor %}")

    def tokenize(example):
        ids, labels = [], []
        for m in example["messages"]:
            t = tokenizer.apply_chat_template([m], tokenize=True)
            ids += t
            labels += t if m["role"] == "assistant" else [-100] * len(t)
        return {"input_ids": ids[: args.max_len], "labels": labels[: args.max_len]}

    with accelerator.main_process_first():
        raw = load_dataset(args.dataset)
        train_ds = raw["train_sft"].map(tokenize, remove_columns=raw["train_sft"].column_names, num_proc=8)
        eval_ds = raw["test_sft"].select(range(args.max_eval_samples)).map(
            tokenize, remove_columns=raw["test_sft"].column_names, num_proc=8)

    def collate(batch):
        longest = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), longest), tokenizer.pad_token_id)
        lab = torch.full((len(batch), longest), -100)
        att = torch.zeros((len(batch), longest), dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n] = torch.tensor(b["input_ids"])
            lab[i, :n] = torch.tensor(b["labels"])
            att[i, :n] = 1
        return {"input_ids": ids, "labels": lab, "attention_mask": att}

    train_loader = DataLoader(train_ds, batch_size=args.per_device_batch_size, shuffle=True, collate_fn=collate,
                              num_workers=2)
    eval_loader = DataLoader(eval_ds, batch_size=args.per_device_batch_size, collate_fn=collate)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                             "gate_proj", "up_proj", "down_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=0.0)

    # length of the loader per process after sharding
    steps_per_epoch = math.ceil(len(train_loader) / state.num_processes / accum)
    max_steps = steps_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer,
                                                num_warmup_steps=args.warmup_steps * accelerator.num_processes,
                                                num_training_steps=max_steps * accelerator.num_processes)

    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)
    accelerator.init_trackers("mistral-lora-chat", config=vars(args))

    def run_eval():
        model.eval()
        losses = []
        for batch in eval_loader:
            with torch.no_grad():
                loss = model(**batch).loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(batch["input_ids"].size(0))))
        model.train()
        return torch.cat(losses).mean().item()

    completed = 0
    model.train()
    for epoch in range(args.epochs):
        for batch in train_loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

            if accelerator.sync_gradients:
                completed += 1
                if completed % 10 == 0:
                    avg = accelerator.reduce(loss.detach(), reduction="mean").item()
                    accelerator.log({"train_loss": avg, "lr": scheduler.get_last_lr()[0]}, step=completed)
                    logger.info(f"step {completed}/{max_steps} loss {avg:.4f}", main_process_only=True)
                if completed % args.eval_steps == 0:
                    eval_loss = run_eval()
                    accelerator.log({"eval_loss": eval_loss, "eval_ppl": math.exp(eval_loss)}, step=completed)
                    logger.info(f"step {completed}: eval loss {eval_loss:.4f}")
                    accelerator.wait_for_everyone()
                    unwrapped = accelerator.unwrap_model(model)
                    unwrapped.save_pretrained(os.path.join(args.output_dir, f"step_{completed}"),
                                              is_main_process=accelerator.is_main_process,
                                              save_function=accelerator.save)

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
    accelerator.end_training()


if __name__ == "__main__":
    main()
