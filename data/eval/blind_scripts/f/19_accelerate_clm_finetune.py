#!/usr/bin/env python
"""Causal-LM fine-tuning (GPT-2 / Pythia family) on a folder of text files with Hugging Face Accelerate.

    accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 finetune_clm.py \
        --model_name EleutherAI/pythia-410m --train_dir data/train --valid_dir data/valid \
        --output_dir out/pythia410m-ft --per_device_batch_size 8 --gradient_accumulation_steps 4
"""
import argparse
import glob
import logging
import math
import os

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_cosine_schedule_with_warmup

logger = get_logger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name", default="EleutherAI/pythia-410m")
    p.add_argument("--train_dir", required=True)
    p.add_argument("--valid_dir", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--per_device_batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=4)
    p.add_argument("--learning_rate", type=float, default=3e-5, help="for the global batch of 128 sequences")
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--num_train_epochs", type=int, default=2)
    p.add_argument("--warmup_ratio", type=float, default=0.03)
    p.add_argument("--checkpointing_steps", type=int, default=500)
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              step_scheduler_with_optimizer=False, log_with="tensorboard",
                              project_dir=args.output_dir)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    logger.info(accelerator.state, main_process_only=False)
    set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model_name, torch_dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    raw = load_dataset("text", data_files={"train": sorted(glob.glob(os.path.join(args.train_dir, "*.txt"))),
                                           "validation": sorted(glob.glob(os.path.join(args.valid_dir, "*.txt")))})

    def tokenize(batch):
        return tokenizer([t + tokenizer.eos_token for t in batch["text"]])

    def group_texts(examples):
        concatenated = {k: sum(examples[k], []) for k in examples.keys()}
        total = (len(concatenated["input_ids"]) // args.block_size) * args.block_size
        result = {k: [t[i:i + args.block_size] for i in range(0, total, args.block_size)]
                  for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    # the main process tokenizes and writes the Arrow cache, the others then load it
    with accelerator.main_process_first():
        tokenized = raw.map(tokenize, batched=True, num_proc=8, remove_columns=["text"],
                            desc="Running tokenizer on dataset")
        lm_datasets = tokenized.map(group_texts, batched=True, num_proc=8,
                                    desc=f"Grouping texts in chunks of {args.block_size}")

    train_dataloader = DataLoader(lm_datasets["train"], shuffle=True, collate_fn=default_data_collator,
                                  batch_size=args.per_device_batch_size)
    eval_dataloader = DataLoader(lm_datasets["validation"], collate_fn=default_data_collator,
                                 batch_size=args.per_device_batch_size)

    no_decay = ["bias", "layer_norm.weight", "LayerNorm.weight", "ln_f.weight"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, 0.95))

    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader)

    # lengths are per process after prepare()
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    lr_scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * max_train_steps),
                                                   max_train_steps)
    accelerator.register_for_checkpointing(lr_scheduler)
    accelerator.init_trackers("clm_finetune", config=vars(args))

    total_batch = args.per_device_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    logger.info(f"  Num examples = {len(lm_datasets['train'])}, total batch = {total_batch}, "
                f"optimization steps = {max_train_steps}")

    completed_steps, starting_epoch, resume_step = 0, 0, None
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        completed_steps = int(os.path.basename(args.resume_from_checkpoint.rstrip("/")).split("_")[1])
        starting_epoch = completed_steps // num_update_steps_per_epoch
        resume_step = (completed_steps % num_update_steps_per_epoch) * args.gradient_accumulation_steps

    progress_bar = tqdm(range(max_train_steps), initial=completed_steps,
                        disable=not accelerator.is_local_main_process)
    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        if resume_step is not None and epoch == starting_epoch:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for batch in active_dataloader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                lr_scheduler.step()
                progress_bar.update(1)
                completed_steps += 1
                if completed_steps % 10 == 0:
                    avg_loss = accelerator.reduce(loss.detach().float(), reduction="mean")
                    accelerator.log({"train_loss": avg_loss.item(),
                                     "lr": lr_scheduler.get_last_lr()[0]}, step=completed_steps)
                if completed_steps % args.checkpointing_steps == 0:
                    accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))

        model.eval()
        losses = []
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            loss = outputs.loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_batch_size)))
        losses = torch.cat(losses)
        eval_loss = torch.mean(losses)
        perplexity = math.exp(eval_loss) if eval_loss < 20 else float("inf")
        logger.info(f"epoch {epoch}: perplexity: {perplexity:.3f} eval_loss: {eval_loss:.4f}")
        accelerator.log({"perplexity": perplexity, "eval_loss": eval_loss.item(), "epoch": epoch},
                        step=completed_steps)

    accelerator.end_training()
    accelerator.wait_for_everyone()
    unwrapped_model = accelerator.unwrap_model(model)
    unwrapped_model.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                                    save_function=accelerator.save)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)


if __name__ == "__main__":
    main()
