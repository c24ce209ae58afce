#!/usr/bin/env python
"""Continued pre-training of a small causal LM on the in-house docs corpus.

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 07_clm_domain_adapt.py \
        --train_files "corpus/train-*.jsonl" --validation_file corpus/valid.jsonl \
        --model_name_or_path EleutherAI/pythia-410m --output_dir runs/pythia_docs
"""
import argparse
import glob
import json
import logging
import math
import os
from itertools import chain

import datasets
import torch
import torch.distributed as dist
import transformers
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_scheduler

logger = get_logger(__name__)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_files", required=True, help="glob of jsonl files with a 'text' field")
    parser.add_argument("--validation_file", required=True)
    parser.add_argument("--model_name_or_path", default="EleutherAI/pythia-410m")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--block_size", type=int, default=1024)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=2e-5)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--max_train_steps", type=int, default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    parser.add_argument("--lr_scheduler_type", default="cosine")
    parser.add_argument("--num_warmup_steps", type=int, default=200)
    parser.add_argument("--checkpointing_steps", type=int, default=1000)
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--preprocessing_num_workers", type=int, default=16)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              log_with="tensorboard", project_dir=args.output_dir)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    logger.info(accelerator.state, main_process_only=False)
    if accelerator.is_local_main_process:
        datasets.utils.logging.set_verbosity_warning()
        transformers.utils.logging.set_verbosity_warning()
    else:
        datasets.utils.logging.set_verbosity_error()
        transformers.utils.logging.set_verbosity_error()
    set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    data_files = {"train": sorted(glob.glob(args.train_files)), "validation": args.validation_file}
    raw = datasets.load_dataset("json", data_files=data_files)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, torch_dtype=torch.float32)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False

    def tokenize(examples):
        return tokenizer([t + tokenizer.eos_token for t in examples["text"]])

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
        total = (len(concatenated["input_ids"]) // args.block_size) * args.block_size
        result = {k: [t[i: i + args.block_size] for i in range(0, total, args.block_size)]
                  for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    # rank 0 builds the Arrow cache first, the others then load it
    with accelerator.main_process_first():
        tokenized = raw.map(tokenize, batched=True, num_proc=args.preprocessing_num_workers,
                            remove_columns=raw["train"].column_names, desc="tokenize")
        lm_datasets = tokenized.map(group_texts, batched=True, num_proc=args.preprocessing_num_workers,
                                    desc=f"group into {args.block_size}")

    train_loader = DataLoader(lm_datasets["train"], shuffle=True, collate_fn=default_data_collator,
                              batch_size=args.per_device_train_batch_size)
    eval_loader = DataLoader(lm_datasets["validation"], collate_fn=default_data_collator,
                             batch_size=args.per_device_eval_batch_size)

    no_decay = ["bias", "layer_norm.weight", "LayerNorm.weight"]
    params = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, betas=(0.9, 0.95))

    # Steps are counted on the unsharded loader: the prepared scheduler is stepped once per
    # process at every optimizer step, so these totals come out right for any world size.
    overrode_max_train_steps = False
    num_update_steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
        overrode_max_train_steps = True
    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps if overrode_max_train_steps
        else args.max_train_steps * accelerator.num_processes,
    )

    model, optimizer, train_loader, eval_loader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, lr_scheduler
    )

    num_update_steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    if overrode_max_train_steps:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)

    accelerator.init_trackers("clm_docs", {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str))})

    total_batch = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    logger.info(f"examples={len(lm_datasets['train'])} epochs={args.num_train_epochs} "
                f"global batch={total_batch} optimizer steps={args.max_train_steps} "
                f"world={dist.get_world_size() if dist.is_initialized() else 1}")

    completed_steps, starting_epoch, resume_step = 0, 0, None
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        with open(os.path.join(args.resume_from_checkpoint, "trainer_state.json")) as f:
            completed_steps = json.load(f)["completed_steps"]
        starting_epoch = completed_steps // num_update_steps_per_epoch
        resume_step = (completed_steps % num_update_steps_per_epoch) * args.gradient_accumulation_steps
        logger.info(f"resumed at step {completed_steps} (epoch {starting_epoch})")

    progress = tqdm(range(args.max_train_steps), initial=completed_steps,
                    disable=not accelerator.is_local_main_process)
    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        if resume_step is not None and epoch == starting_epoch:
            active_loader = accelerator.skip_first_batches(train_loader, resume_step)
        else:
            active_loader = train_loader
        window_loss = torch.zeros((), device=accelerator.device)
        for batch in active_loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                window_loss += loss.detach() / args.gradient_accumulation_steps
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

            if accelerator.sync_gradients:
                progress.update(1)
                completed_steps += 1
                step_loss = accelerator.reduce(window_loss, reduction="mean").item()
                window_loss.zero_()
                if completed_steps % 10 == 0:
                    accelerator.log({"train_loss": step_loss, "lr": lr_scheduler.get_last_lr()[0]},
                                    step=completed_steps)
                if completed_steps % args.checkpointing_steps == 0:
                    ckpt_dir = os.path.join(args.output_dir, f"step_{completed_steps}")
                    accelerator.save_state(ckpt_dir)
                    if accelerator.is_main_process:
                        with open(os.path.join(ckpt_dir, "trainer_state.json"), "w") as f:
                            json.dump({"completed_steps": completed_steps}, f)
            if completed_steps >= args.max_train_steps:
                break

        model.eval()
        losses = []
        for batch in eval_loader:
            with torch.no_grad():
                loss = model(**batch).loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(batch["input_ids"].shape[0])))
        eval_loss = torch.cat(losses).mean()
        try:
            perplexity = math.exp(eval_loss)
        except OverflowError:
            perplexity = float("inf")
        logger.info(f"epoch {epoch}: eval_loss {eval_loss.item():.4f} perplexity {perplexity:.2f}")
        accelerator.log({"eval_loss": eval_loss.item(), "perplexity": perplexity}, step=completed_steps)

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
    accelerator.end_training()


if __name__ == "__main__":
    main()
