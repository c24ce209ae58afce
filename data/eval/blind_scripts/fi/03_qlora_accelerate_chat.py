"""QLoRA fine-tune of a chat model on our support transcripts with Accelerate.

    accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 \
        03_qlora_accelerate_chat.py --model meta-llama/Meta-Llama-3-8B-Instruct \
        --data data/transcripts --output_dir runs/chat-qlora
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    DataCollatorForSeq2Seq,
    get_cosine_schedule_with_warmup,
)
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

logger = get_logger(__name__)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="meta-llama/Meta-Llama-3-8B-Instruct")
    parser.add_argument("--data", required=True, help="folder with train.jsonl / validation.jsonl")
    parser.add_argument("--output_dir", default="runs/chat-qlora")
    parser.add_argument("--max_seq_len", type=int, default=2048)
    parser.add_argument("--per_device_batch_size", type=int, default=2)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--num_epochs", type=int, default=2)
    parser.add_argument("--warmup_steps", type=int, default=50)
    parser.add_argument("--lora_r", type=int, default=64)
    parser.add_argument("--lora_alpha", type=int, default=16)
    parser.add_argument("--eval_steps", type=int, default=250)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--report_to", default="wandb")
    return parser.parse_args()


def build_tokenize_fn(tokenizer, max_len):
    def tokenize(example):
        messages = example["messages"]
        prompt_ids = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True)
        full_ids = tokenizer.apply_chat_template(messages)
        full_ids = full_ids[:max_len]
        labels = list(full_ids)
        n_prompt = min(len(prompt_ids), len(full_ids))
        labels[:n_prompt] = [-100] * n_prompt
        return {"input_ids": full_ids, "attention_mask": [1] * len(full_ids), "labels": labels}
    return tokenize


def main():
    args = parse_args()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=args.report_to,
        project_dir=args.output_dir,
    )
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = "<|finetune_right_pad_id|>" if "<|finetune_right_pad_id|>" in tokenizer.get_vocab() else tokenizer.eos_token

    raw = load_dataset(
        "json",
        data_files={"train": os.path.join(args.data, "train.jsonl"),
                    "validation": os.path.join(args.data, "validation.jsonl")},
    )
    with accelerator.main_process_first():
        tokenized = raw.map(
            build_tokenize_fn(tokenizer, args.max_seq_len),
            remove_columns=raw["train"].column_names,
            num_proc=8,
            desc="tokenizing",
        )

    collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, pad_to_multiple_of=8)
    train_loader = DataLoader(tokenized["train"], batch_size=args.per_device_batch_size,
                              shuffle=True, collate_fn=collator, num_workers=4)
    eval_loader = DataLoader(tokenized["validation"], batch_size=args.per_device_batch_size,
                             collate_fn=collator)

    bnb_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        args.model,
        quantization_config=bnb_config,
        torch_dtype=torch.bfloat16,
        device_map="auto",
        attn_implementation="sdpa",
    )
    model.config.use_cache = False
    model = prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    model.enable_input_require_grads()

    peft_config = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=0.1,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, peft_config)
    if accelerator.is_main_process:
        model.print_trainable_parameters()

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=args.learning_rate)
    updates_per_epoch = math.ceil(
        len(train_loader) / accelerator.num_processes / args.gradient_accumulation_steps)
    max_train_steps = updates_per_epoch * args.num_epochs
    scheduler = get_cosine_schedule_with_warmup(
        optimizer,
        num_warmup_steps=args.warmup_steps * accelerator.num_processes,
        num_training_steps=max_train_steps * accelerator.num_processes,
    )

    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)

    accelerator.init_trackers("support-chat-qlora", config=vars(args))

    def run_eval():
        model.eval()
        losses = []
        for batch in eval_loader:
            with torch.no_grad():
                loss = model(**batch).loss
            losses.append(accelerator.gather_for_metrics(loss.detach().repeat(batch["input_ids"].shape[0])))
        model.train()
        loss = torch.cat(losses).mean().item()
        return loss, math.exp(min(loss, 20))

    completed = 0
    for epoch in range(args.num_epochs):
        model.train()
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
                    accelerator.log({"train/loss": loss.item(),
                                     "train/lr": scheduler.get_last_lr()[0]}, step=completed)
                if completed % args.eval_steps == 0:
                    eval_loss, ppl = run_eval()
                    accelerator.log({"eval/loss": eval_loss, "eval/ppl": ppl}, step=completed)
                    logger.info(f"step {completed}: eval loss {eval_loss:.4f} ppl {ppl:.2f}")

        accelerator.wait_for_everyone()
        save_dir = os.path.join(args.output_dir, f"epoch_{epoch}")
        unwrapped = accelerator.unwrap_model(model)
        if accelerator.is_main_process:
            unwrapped.save_pretrained(save_dir)
            tokenizer.save_pretrained(save_dir)
        accelerator.wait_for_everyone()

    eval_loss, ppl = run_eval()
    logger.info(f"final eval loss {eval_loss:.4f} ppl {ppl:.2f}")
    accelerator.log({"eval/loss": eval_loss, "eval/ppl": ppl}, step=completed)
    accelerator.end_training()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
