#!/usr/bin/env python
"""Packed chat SFT of Qwen2.5-1.5B with 🤗 Accelerate (adapted from run_clm_no_trainer.py).

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 16_accelerate_packed_sft.py \
        --dataset_name HuggingFaceH4/ultrachat_200k --output_dir out/qwen25-1.5b-ultrachat --with_tracking
"""
import argparse
import logging
import math
import os
from itertools import chain

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_scheduler

logger = get_logger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name_or_path", default="Qwen/Qwen2.5-1.5B")
    p.add_argument("--dataset_name", default="HuggingFaceH4/ultrachat_200k")
    p.add_argument("--train_split", default="train_sft")
    p.add_argument("--eval_split", default="test_sft")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--block_size", type=int, default=2048)
    p.add_argument("--per_device_train_batch_size", type=int, default=4)
    p.add_argument("--per_device_eval_batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=4)
    p.add_argument("--learning_rate", type=float, default=2e-5)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--num_train_epochs", type=int, default=1)
    p.add_argument("--num_warmup_steps", type=int, default=100)
    p.add_argument("--checkpointing_steps", type=int, default=1000)
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--preprocessing_num_workers", type=int, default=16)
    p.add_argument("--max_eval_samples", type=int, default=4000)
    p.add_argument("--with_tracking", action="store_true")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with="wandb" if args.with_tracking else None,
        project_dir=args.output_dir,
    )
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    raw = load_dataset(args.dataset_name)
    raw_eval = raw[args.eval_split].select(range(min(args.max_eval_samples, len(raw[args.eval_split]))))

    def tokenize(batch):
        out = {"input_ids": [], "labels": []}
        for msgs in batch["messages"]:
            ids, labels = [], []
            for i, m in enumerate(msgs):
                upto = tokenizer.apply_chat_template(msgs[: i + 1])
                if m["role"] == "assistant":
                    head = tokenizer.apply_chat_template(msgs[:i], add_generation_prompt=True)
                    labels += [-100] * (len(head) - len(labels)) + upto[len(head):]
                else:
                    labels += [-100] * (len(upto) - len(labels))
                ids = upto
            ids.append(tokenizer.eos_token_id)
            labels.append(-100)
            out["input_ids"].append(ids)
            out["labels"].append(labels)
        return out

    block_size = args.block_size

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
        total_length = (len(concatenated["input_ids"]) // block_size) * block_size
        result = {k: [t[i : i + block_size] for i in range(0, total_length, block_size)]
                  for k, t in concatenated.items()}
        result["attention_mask"] = [[1] * block_size for _ in result["input_ids"]]
        return result

    # tokenised + packed once by the main process, the other ranks then read the datasets cache
    with accelerator.main_process_first():
        train_tok = raw[args.train_split].map(tokenize, batched=True, num_proc=args.preprocessing_num_workers,
                                              remove_columns=raw[args.train_split].column_names,
                                              desc="tokenize train")
        eval_tok = raw_eval.map(tokenize, batched=True, num_proc=args.preprocessing_num_workers,
                                remove_columns=raw_eval.column_names, desc="tokenize eval")
        train_ds = train_tok.map(group_texts, batched=True, num_proc=args.preprocessing_num_workers,
                                 desc=f"packing into {block_size}")
        eval_ds = eval_tok.map(group_texts, batched=True, num_proc=args.preprocessing_num_workers,
                               desc=f"packing into {block_size}")

    train_dataloader = DataLoader(train_ds, shuffle=True, collate_fn=default_data_collator,
                                  batch_size=args.per_device_train_batch_size, num_workers=2)
    eval_dataloader = DataLoader(eval_ds, collate_fn=default_data_collator,
                                 batch_size=args.per_device_eval_batch_size)

    # fp32 master weights; the forward runs under the launcher's bf16 autocast
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = accelerator.prepare(model)

    no_decay = ["bias", "norm.weight"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate)
    optimizer, train_dataloader, eval_dataloader = accelerator.prepare(optimizer, train_dataloader, eval_dataloader)

    # len(train_dataloader) is per process after prepare()
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    # the prepared scheduler is stepped once per process, hence the scaling
    lr_scheduler = get_scheduler("cosine", optimizer=optimizer,
                                 num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
                                 num_training_steps=max_train_steps * accelerator.num_processes)
    lr_scheduler = accelerator.prepare(lr_scheduler)

    if args.with_tracking:
        accelerator.init_trackers("ultrachat-sft", config=vars(args))

    completed_steps, starting_epoch, resume_step = 0, 0, None
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        completed_steps = int(os.path.basename(args.resume_from_checkpoint.rstrip("/")).split("_")[1])
        starting_epoch = completed_steps // num_update_steps_per_epoch
        resume_step = (completed_steps % num_update_steps_per_epoch) * args.gradient_accumulation_steps

    progress = tqdm(range(max_train_steps), initial=completed_steps, disable=not accelerator.is_local_main_process)
    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        if resume_step and epoch == starting_epoch:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for batch in active_dataloader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

            if not accelerator.sync_gradients:
                continue
            progress.update(1)
            completed_steps += 1
            if completed_steps % 10 == 0:
                avg_loss = accelerator.reduce(loss.detach(), reduction="mean")
                progress.set_postfix(loss=f"{avg_loss.item():.4f}")
                if args.with_tracking:
                    accelerator.log({"train_loss": avg_loss.item(), "lr": lr_scheduler.get_last_lr()[0]},
                                    step=completed_steps)
            if completed_steps % args.checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))

        model.eval()
        losses = []
        for batch in eval_dataloader:
            with torch.no_grad():
                loss = model(**batch).loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(batch["input_ids"].shape[0])))
        eval_loss = torch.cat(losses).mean()
        perplexity = math.exp(eval_loss.item())
        logger.info(f"epoch {epoch}: eval_loss {eval_loss.item():.4f} perplexity {perplexity:.2f}")
        if args.with_tracking:
            accelerator.log({"eval_loss": eval_loss.item(), "perplexity": perplexity, "epoch": epoch},
                            step=completed_steps)

        if accelerator.is_main_process:
            gen_model = accelerator.unwrap_model(model)
            gen_model.config.use_cache = True
            for msgs in raw_eval.select(range(3))["messages"]:
                prompt = tokenizer.apply_chat_template(msgs[:1], add_generation_prompt=True, return_tensors="pt")
                prompt = prompt.to(accelerator.device)
                with torch.no_grad():
                    out = gen_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=128,
                                             do_sample=False, pad_token_id=tokenizer.pad_token_id)
                logger.info("PROMPT: %s\nGEN: %s", msgs[0]["content"][:200],
                            tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True))
            gen_model.config.use_cache = False
        accelerator.wait_for_everyone()

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
    accelerator.end_training()


if __name__ == "__main__":
    main()
