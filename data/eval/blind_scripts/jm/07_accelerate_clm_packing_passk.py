#!/usr/bin/env python
# coding=utf-8
"""Causal-LM fine-tuning of a code model with 🤗 Accelerate (run_clm_no_trainer style),
group_texts packing, and a pass@k check on MBPP after each epoch.

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 \
        07_accelerate_clm_packing_passk.py --dataset_name my-org/python-functions
"""
import argparse
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
from itertools import chain

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import gather_object, set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_scheduler

logger = get_logger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name_or_path", default="bigcode/starcoderbase-1b")
    p.add_argument("--dataset_name", required=True)
    p.add_argument("--block_size", type=int, default=2048)
    p.add_argument("--per_device_train_batch_size", type=int, default=4)
    p.add_argument("--per_device_eval_batch_size", type=int, default=4)
    p.add_argument("--gradient_accumulation_steps", type=int, default=4)
    p.add_argument("--learning_rate", type=float, default=5e-5)
    p.add_argument("--num_train_epochs", type=int, default=2)
    p.add_argument("--num_warmup_steps", type=int, default=100)
    p.add_argument("--preprocessing_num_workers", type=int, default=16)
    p.add_argument("--num_samples", type=int, default=10)
    p.add_argument("--output_dir", default="outputs/clm-mbpp")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def mbpp_program(problem, completion):
    tests = "\n".join(problem["test_list"])
    return f"{problem['test_setup_code']}\n{completion}\n\n{tests}\n"


def execute(program, timeout=5.0):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "main.py")
        with open(path, "w") as f:
            f.write(program)
        try:
            return subprocess.run([sys.executable, path], cwd=d, capture_output=True, timeout=timeout).returncode == 0
        except subprocess.TimeoutExpired:
            return False


def pass_at_k(n, c, k):
    if n - c < k:
        return 1.0
    return 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1))


def mbpp_prompt(problem):
    return f'"""\n{problem["text"]}\n{problem["test_list"][0]}\n"""\n'


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, log_with="tensorboard",
                              project_dir=args.output_dir)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    logger.info(accelerator.state, main_process_only=False)
    set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    raw = load_dataset(args.dataset_name)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    block_size = args.block_size

    def tokenize(examples):
        return tokenizer([c + tokenizer.eos_token for c in examples["content"]])

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
        total = (len(concatenated["input_ids"]) // block_size) * block_size
        result = {k: [t[i : i + block_size] for i in range(0, total, block_size)] for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    with accelerator.main_process_first():
        tokenized = raw.map(tokenize, batched=True, num_proc=args.preprocessing_num_workers,
                            remove_columns=raw["train"].column_names, desc="tokenize")
        lm_datasets = tokenized.map(group_texts, batched=True, num_proc=args.preprocessing_num_workers,
                                    desc=f"pack into {block_size}")

    train_dl = DataLoader(lm_datasets["train"], shuffle=True, collate_fn=default_data_collator,
                          batch_size=args.per_device_train_batch_size)
    eval_dl = DataLoader(lm_datasets["validation"], collate_fn=default_data_collator,
                         batch_size=args.per_device_eval_batch_size)
    mbpp = list(load_dataset("mbpp", split="test"))

    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    no_decay = ["bias", "ln_1.weight", "ln_2.weight", "ln_f.weight"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.1},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate)

    model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)

    # len(train_dl) is per process after prepare(); the prepared scheduler steps once per process
    num_update_steps_per_epoch = math.ceil(len(train_dl) / args.gradient_accumulation_steps)
    max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    lr_scheduler = get_scheduler("cosine", optimizer=optimizer,
                                 num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
                                 num_training_steps=max_train_steps * accelerator.num_processes)
    lr_scheduler = accelerator.prepare(lr_scheduler)

    accelerator.init_trackers("clm_mbpp", config=vars(args))

    total_batch = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    logger.info(f"  Total train batch size = {total_batch}, optimization steps = {max_train_steps}")
    progress = tqdm(range(max_train_steps), disable=not accelerator.is_local_main_process)
    completed = 0

    for epoch in range(args.num_train_epochs):
        model.train()
        for batch in train_dl:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                progress.update(1)
                completed += 1
                if completed % 20 == 0:
                    accelerator.log({"train_loss": accelerator.reduce(loss.detach(), "mean").item(),
                                     "lr": lr_scheduler.get_last_lr()[0]}, step=completed)

        model.eval()
        losses = []
        for batch in eval_dl:
            with torch.no_grad():
                out = model(**batch)
            losses.append(accelerator.gather_for_metrics(out.loss.repeat(args.per_device_eval_batch_size)))
        eval_loss = torch.cat(losses).mean().item()

        unwrapped = accelerator.unwrap_model(model)
        results = []
        with accelerator.split_between_processes(mbpp) as my_problems:
            for prob in my_problems:
                enc = tokenizer(mbpp_prompt(prob), return_tensors="pt").to(accelerator.device)
                with torch.no_grad():
                    gen = unwrapped.generate(**enc, do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=256,
                                             num_return_sequences=args.num_samples,
                                             pad_token_id=tokenizer.eos_token_id)
                texts = tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
                texts = [t.split("\nassert")[0].split('\n"""')[0] for t in texts]
                n_ok = sum(execute(mbpp_program(prob, t)) for t in texts)
                results.append({"task_id": prob["task_id"], "n": len(texts), "c": n_ok})
        results = gather_object(results)
        p1 = float(np.mean([pass_at_k(r["n"], r["c"], 1) for r in results]))
        p10 = float(np.mean([pass_at_k(r["n"], r["c"], 10) for r in results]))
        logger.info(f"epoch {epoch}: eval_loss {eval_loss:.4f} ppl {math.exp(eval_loss):.2f} "
                    f"mbpp pass@1 {p1:.4f} pass@10 {p10:.4f} ({len(results)} problems)")
        accelerator.log({"eval_loss": eval_loss, "mbpp_pass@1": p1, "mbpp_pass@10": p10}, step=completed)

        accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
        with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
            json.dump({"eval_loss": eval_loss, "mbpp_pass@1": p1, "mbpp_pass@10": p10}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
