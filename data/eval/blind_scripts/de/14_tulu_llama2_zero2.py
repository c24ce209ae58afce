#!/usr/bin/env python
# Tulu-v2-style full fine-tuning of Llama-2-7B with HF Trainer + DeepSpeed ZeRO-2.
#
#   deepspeed --num_gpus 8 14_tulu_llama2_zero2.py --dataset allenai/tulu-v2-sft-mixture \
#       --output_dir output/tulu2-7b
import argparse
import logging
import math
import os

import torch
from datasets import load_dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Trainer,
    TrainingArguments,
)

logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name_or_path", default="meta-llama/Llama-2-7b-hf")
    parser.add_argument("--dataset", default="allenai/tulu-v2-sft-mixture")
    parser.add_argument("--output_dir", default="output/tulu2-7b")
    parser.add_argument("--max_seq_length", type=int, default=2048)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=2e-5)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--warmup_ratio", type=float, default=0.03)
    parser.add_argument("--eval_size", type=int, default=2000)
    parser.add_argument("--preprocessing_num_workers", type=int, default=32)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher
    return parser.parse_args()


def build_ds_config(args):
    return {
        # global batch of 256 sequences, as in the Tulu 2 recipe
        "train_batch_size": 256,
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 2,
            "allgather_partitions": True,
            "allgather_bucket_size": 5e8,
            "overlap_comm": True,
            "reduce_scatter": True,
            "reduce_bucket_size": 5e8,
            "contiguous_gradients": True,
        },
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": args.learning_rate, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": args.learning_rate,
                       "warmup_num_steps": "auto", "total_num_steps": "auto"},
        },
        "steps_per_print": 50,
        "wall_clock_breakdown": False,
    }


def encode_with_messages_format(example, tokenizer, max_seq_length):
    """Tulu format: <|user|>\n...\n<|assistant|>\n...</s>; loss only on assistant text."""
    messages = example["messages"]

    def concat(msgs):
        text = ""
        for m in msgs:
            if m["role"] == "system":
                text += "<|system|>\n" + m["content"].strip() + "\n"
            elif m["role"] == "user":
                text += "<|user|>\n" + m["content"].strip() + "\n"
            elif m["role"] == "assistant":
                text += "<|assistant|>\n" + m["content"].strip() + tokenizer.eos_token + "\n"
        return text

    full = concat(messages).strip()
    tok = tokenizer(full, return_tensors="pt", max_length=max_seq_length, truncation=True)
    input_ids = tok.input_ids
    labels = input_ids.clone()
    for idx, m in enumerate(messages):
        if m["role"] == "assistant":
            continue
        start = 0 if idx == 0 else tokenizer(concat(messages[:idx]), return_tensors="pt",
                                             max_length=max_seq_length, truncation=True).input_ids.shape[1]
        if idx < len(messages) - 1 and messages[idx + 1]["role"] == "assistant":
            prefix = concat(messages[: idx + 1]) + "<|assistant|>\n"
        else:
            prefix = concat(messages[: idx + 1])
        end = tokenizer(prefix, return_tensors="pt", max_length=max_seq_length, truncation=True).input_ids.shape[1]
        labels[:, start:end] = -100
        if end >= max_seq_length:
            break
    return {"input_ids": input_ids.flatten(), "labels": labels.flatten(),
            "attention_mask": torch.ones_like(input_ids).flatten()}


def main():
    args = parse_args()
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        deepspeed=build_ds_config(args),
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        num_train_epochs=args.num_train_epochs,
        warmup_ratio=args.warmup_ratio,
        lr_scheduler_type="linear",
        bf16=True,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        logging_steps=10,
        eval_strategy="steps",
        eval_steps=500,
        save_strategy="steps",
        save_steps=1000,
        save_total_limit=2,
        report_to=["tensorboard"],
        seed=args.seed,
        dataloader_num_workers=4,
    )
    logging.basicConfig(level=logging.INFO if training_args.should_log else logging.WARNING)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, use_fast=True)
    tokenizer.add_special_tokens({"pad_token": "<pad>"})

    raw = load_dataset(args.dataset, split="train")
    split = raw.train_test_split(test_size=args.eval_size, seed=args.seed)
    with training_args.main_process_first(desc="tokenizing tulu mixture"):
        tokenized = split.map(
            encode_with_messages_format,
            fn_kwargs={"tokenizer": tokenizer, "max_seq_length": args.max_seq_length},
            num_proc=args.preprocessing_num_workers,
            remove_columns=split["train"].column_names,
            desc="tokenizing",
        )
        tokenized = tokenized.filter(lambda ex: any(l != -100 for l in ex["labels"]),
                                    num_proc=args.preprocessing_num_workers)
    tokenized.set_format("pt")

    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, torch_dtype=torch.bfloat16,
                                                 attn_implementation="flash_attention_2")
    model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=8)
    model.config.pad_token_id = tokenizer.pad_token_id

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["test"],
        tokenizer=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer=tokenizer, padding="longest", label_pad_token_id=-100),
    )
    result = trainer.train()
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()
    trainer.save_model()

    metrics = trainer.evaluate()
    metrics["perplexity"] = math.exp(metrics["eval_loss"])
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
