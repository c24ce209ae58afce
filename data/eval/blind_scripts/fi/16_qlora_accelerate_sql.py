"""Text-to-SQL QLoRA fine-tuning with Accelerate (one 4-bit replica per process).

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 \
        16_qlora_accelerate_sql.py --model codellama/CodeLlama-7b-hf \
        --data_dir data/sql --output_dir runs/sql-qlora
    # resume
    accelerate launch ... 16_qlora_accelerate_sql.py ... --resume_from runs/sql-qlora/state_step2000
"""
import argparse
import math
import os
import re

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DistributedDataParallelKwargs, set_seed
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

logger = get_logger(__name__, log_level="INFO")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="codellama/CodeLlama-7b-hf")
    p.add_argument("--data_dir", required=True)
    p.add_argument("--output_dir", default="runs/sql-qlora")
    p.add_argument("--max_len", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--checkpoint_every", type=int, default=1000)
    p.add_argument("--resume_from", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def schema_prompt(ex):
    return (f"-- Database schema:\n{ex['schema']}\n-- Question: {ex['question']}\n"
            f"-- Write a SQL query that answers the question.\nSELECT")


def normalize_sql(sql):
    sql = re.sub(r"\s+", " ", sql.strip().rstrip(";"))
    return sql.lower()


def main():
    args = parse_args()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.grad_accum,
        log_with="tensorboard",
        project_dir=args.output_dir,
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=False)],
    )
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.pad_token = tokenizer.eos_token

    def tokenize(ex):
        p = tokenizer(schema_prompt(ex))["input_ids"]
        # the prompt already ends with SELECT, the target is the rest of the query
        tgt = ex["sql"].strip()
        tgt = tgt[len("SELECT"):] if tgt.upper().startswith("SELECT") else " " + tgt
        t = tokenizer(tgt, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = (p + t)[: args.max_len]
        return {"input_ids": ids, "attention_mask": [1] * len(ids),
                "labels": ([-100] * len(p) + t)[: args.max_len]}

    raw = load_dataset("json", data_files={"train": os.path.join(args.data_dir, "train.jsonl"),
                                           "dev": os.path.join(args.data_dir, "dev.jsonl")})
    # rank 0 builds the datasets cache first, the others then read it
    with accelerator.main_process_first():
        train_ds = raw["train"].map(tokenize, remove_columns=raw["train"].column_names, num_proc=8)
    dev_raw = raw["dev"]

    model = AutoModelForCausalLM.from_pretrained(
        args.model,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=torch.bfloat16,
                                               bnb_4bit_use_double_quant=True),
        torch_dtype=torch.bfloat16,
        device_map={"": accelerator.local_process_index},
    )
    model.config.use_cache = False
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))

    collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, pad_to_multiple_of=8)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, collate_fn=collator,
                              num_workers=2)
    dev_loader = DataLoader(list(range(len(dev_raw))), batch_size=8)

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    model, optimizer, train_loader, dev_loader = accelerator.prepare(model, optimizer, train_loader, dev_loader)

    # train_loader is already sharded here, so this is the per-process number of updates;
    # the prepared scheduler advances num_processes steps per optimizer update
    updates_per_epoch = math.ceil(len(train_loader) / args.grad_accum)
    total_updates = updates_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(
        optimizer,
        num_warmup_steps=int(0.03 * total_updates) * accelerator.num_processes,
        num_training_steps=total_updates * accelerator.num_processes,
    )
    scheduler = accelerator.prepare(scheduler)

    accelerator.init_trackers("sql-qlora", config=vars(args))

    completed, start_epoch, skip_batches = 0, 0, 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)  # every process restores its own RNG state
        completed = int(args.resume_from.rstrip("/").split("step")[-1])
        start_epoch = completed // updates_per_epoch
        skip_batches = (completed % updates_per_epoch) * args.grad_accum

    def exact_match():
        model.eval()
        unwrapped = accelerator.unwrap_model(model)
        tokenizer.padding_side = "left"
        hits = []
        for idx in dev_loader:
            rows = [dev_raw[int(i)] for i in idx]
            enc = tokenizer([schema_prompt(r) for r in rows], return_tensors="pt", padding=True).to(accelerator.device)
            with torch.no_grad():
                out = unwrapped.generate(**enc, max_new_tokens=192, do_sample=False,
                                         pad_token_id=tokenizer.pad_token_id)
            preds = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            ok = [normalize_sql("SELECT" + p) == normalize_sql(r["sql"]) for p, r in zip(preds, rows)]
            hits.append(accelerator.gather_for_metrics(torch.tensor(ok, device=accelerator.device)))
        tokenizer.padding_side = "right"
        model.train()
        return torch.cat(hits).float().mean().item()

    for epoch in range(start_epoch, args.epochs):
        model.train()
        loader = train_loader
        if epoch == start_epoch and skip_batches:
            loader = accelerator.skip_first_batches(train_loader, skip_batches)
        for batch in loader:
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
            completed += 1
            if completed % 10 == 0:
                avg = accelerator.reduce(loss.detach(), reduction="mean")
                accelerator.log({"train_loss": avg.item(), "lr": scheduler.get_last_lr()[0]}, step=completed)
            if completed % args.checkpoint_every == 0:
                # collective: must run on every process
                accelerator.save_state(os.path.join(args.output_dir, f"state_step{completed}"))

        em = exact_match()
        logger.info(f"epoch {epoch}: dev exact match {em:.4f}")
        accelerator.log({"dev_exact_match": em}, step=completed)

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        unwrapped.save_pretrained(os.path.join(args.output_dir, "adapter"))
        tokenizer.save_pretrained(os.path.join(args.output_dir, "adapter"))
    accelerator.end_training()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
