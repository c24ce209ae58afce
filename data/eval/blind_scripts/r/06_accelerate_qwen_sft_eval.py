"""Supervised fine-tuning of a small causal LM on an instruction json file, with
generation-based eval (exact match on the short-answer subset).

accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 06_accelerate_qwen_sft_eval.py
"""
import argparse
import json
import math
import os

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq,
                          get_cosine_schedule_with_warmup)

logger = get_logger(__name__)
PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2-0.5B")
    p.add_argument("--train-file", default="data/sft_train.jsonl")
    p.add_argument("--eval-file", default="data/sft_eval_short.jsonl")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--per-device-bs", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup-ratio", type=float, default=0.03)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--output-dir", default="out/qwen05b-sft")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def build_train(tokenizer, path, max_len):
    ds = load_dataset("json", data_files=path, split="train")

    def tok(ex):
        prompt = PROMPT.format(instruction=ex["instruction"])
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r_ids = tokenizer(ex["output"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        ids = (p_ids + r_ids)[:max_len]
        labels = ([-100] * len(p_ids) + r_ids)[:max_len]
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}

    return ds.map(tok, remove_columns=ds.column_names, num_proc=8, desc="tokenize")


@torch.no_grad()
def generate_eval(accelerator, model, tokenizer, eval_rows, bs=16, max_new_tokens=32):
    model.eval()
    rows = eval_rows[accelerator.process_index::accelerator.num_processes]
    hits = torch.zeros(2, device=accelerator.device)
    for i in range(0, len(rows), bs):
        chunk = rows[i:i + bs]
        prompts = [PROMPT.format(instruction=r["instruction"]) for r in chunk]
        tokenizer.padding_side = "left"
        enc = tokenizer(prompts, return_tensors="pt", padding=True).to(accelerator.device)
        tokenizer.padding_side = "right"
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for r, t in zip(chunk, texts):
            hits[0] += float(t.strip().split("\n")[0].strip().lower() == r["output"].strip().lower())
            hits[1] += 1
    hits = accelerator.reduce(hits, reduction="sum")
    model.train()
    return (hits[0] / hits[1].clamp(min=1)).item()


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, log_with="tensorboard",
                              project_dir=args.output_dir)
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    with accelerator.main_process_first():
        train_ds = build_train(tokenizer, args.train_file, args.max_len)
    with open(args.eval_file) as f:
        eval_rows = [json.loads(l) for l in f]

    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100, pad_to_multiple_of=8)
    train_dl = DataLoader(train_ds, batch_size=args.per_device_bs, shuffle=True, collate_fn=collator,
                          num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    no_decay = ["bias", "norm.weight"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)], "weight_decay": 0.1},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))

    model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
    updates_per_epoch = math.ceil(len(train_dl) / args.grad_accum)
    total_updates = updates_per_epoch * args.epochs
    # the prepared scheduler is stepped once per process on every update
    scheduler = get_cosine_schedule_with_warmup(optimizer,
                                                int(args.warmup_ratio * total_updates) * accelerator.num_processes,
                                                total_updates * accelerator.num_processes)
    scheduler = accelerator.prepare(scheduler)

    accelerator.init_trackers("sft", config=vars(args))
    progress = tqdm(range(total_updates), disable=not accelerator.is_local_main_process)
    step, best_em = 0, -1.0
    for epoch in range(args.epochs):
        model.train()
        for batch in train_dl:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            progress.update(1)
            if step % 10 == 0:
                avg = accelerator.reduce(loss.detach(), reduction="mean").item()
                accelerator.log({"train/loss": avg, "lr": scheduler.get_last_lr()[0]}, step=step)
            if step % args.eval_every == 0 or step == total_updates:
                em = generate_eval(accelerator, model, tokenizer, eval_rows)
                accelerator.log({"eval/exact_match": em}, step=step)
                logger.info(f"step {step}: exact match {em:.4f}", main_process_only=True)
                if em > best_em:
                    best_em = em
                    accelerator.wait_for_everyone()
                    unwrapped = accelerator.unwrap_model(model)
                    unwrapped.save_pretrained(os.path.join(args.output_dir, "best"),
                                              is_main_process=accelerator.is_main_process,
                                              save_function=accelerator.save)
                    if accelerator.is_main_process:
                        tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))

    accelerator.wait_for_everyone()
    accelerator.save_state(os.path.join(args.output_dir, "final_state"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
