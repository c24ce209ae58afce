"""
Abstractive summarization fine-tuning (flan-t5-base) with Accelerate.
Every epoch: beam-search generate on the validation split, ROUGE over all processes,
best-checkpoint tracking + early stopping, resumable via --resume_from.

    accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 \
        06_summ_accelerate_rouge.py --train_file data/train.jsonl --val_file data/val.jsonl
"""
import argparse
import json
import math
import os

import evaluate
import nltk
import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import (AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq,
                          get_scheduler)

logger = get_logger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name", default="google/flan-t5-base")
    p.add_argument("--train_file", required=True)
    p.add_argument("--val_file", required=True)
    p.add_argument("--output_dir", default="out/flan_t5_summ")
    p.add_argument("--max_source_length", type=int, default=768)
    p.add_argument("--max_target_length", type=int, default=128)
    p.add_argument("--per_device_batch_size", type=int, default=8)
    p.add_argument("--grad_accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--num_beams", type=int, default=4)
    p.add_argument("--patience", type=int, default=3)
    p.add_argument("--resume_from", default=None)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def postprocess(preds, labels):
    preds = ["\n".join(nltk.sent_tokenize(p.strip())) for p in preds]
    labels = ["\n".join(nltk.sent_tokenize(l.strip())) for l in labels]
    return preds, labels


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum,
                              log_with="tensorboard", project_dir=args.output_dir)
    set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        nltk.download("punkt", quiet=True)
    accelerator.wait_for_everyone()

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model_name)

    raw = load_dataset("json", data_files={"train": args.train_file, "validation": args.val_file})

    def preprocess(examples):
        inputs = ["summarize: " + d for d in examples["document"]]
        enc = tokenizer(inputs, max_length=args.max_source_length, truncation=True)
        enc["labels"] = tokenizer(text_target=examples["summary"], max_length=args.max_target_length,
                                  truncation=True)["input_ids"]
        return enc

    # tokenize once on the main process, the others pick up the cached arrow files
    with accelerator.main_process_first():
        tokenized = raw.map(preprocess, batched=True, num_proc=8,
                            remove_columns=raw["train"].column_names, desc="tokenizing")

    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100,
                                      pad_to_multiple_of=8)
    train_dl = DataLoader(tokenized["train"], shuffle=True, batch_size=args.per_device_batch_size,
                          collate_fn=collator, num_workers=4)
    val_dl = DataLoader(tokenized["validation"], batch_size=args.per_device_batch_size * 2,
                        collate_fn=collator, num_workers=4)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, optimizer, train_dl, val_dl = accelerator.prepare(model, optimizer, train_dl, val_dl)

    # computed after prepare(): len(train_dl) is already the per-process length.
    # The prepared scheduler is stepped num_processes times per update, hence the factor.
    updates_per_epoch = math.ceil(len(train_dl) / args.grad_accum)
    max_updates = updates_per_epoch * args.epochs
    lr_scheduler = get_scheduler("linear", optimizer,
                                 num_warmup_steps=int(0.05 * max_updates) * accelerator.num_processes,
                                 num_training_steps=max_updates * accelerator.num_processes)
    lr_scheduler = accelerator.prepare(lr_scheduler)
    accelerator.init_trackers("summ", config=vars(args))

    with accelerator.main_process_first():
        rouge = evaluate.load("rouge")
    start_epoch, best_rougeL, bad_epochs = 0, -1.0, 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        with open(os.path.join(args.resume_from, "trainer_meta.json")) as f:
            meta = json.load(f)
        start_epoch, best_rougeL, bad_epochs = meta["epoch"] + 1, meta["best_rougeL"], meta["bad_epochs"]
        logger.info(f"resumed from {args.resume_from} at epoch {start_epoch}", main_process_only=True)

    global_step = start_epoch * updates_per_epoch
    for epoch in range(start_epoch, args.epochs):
        model.train()
        train_dl.set_epoch(epoch)
        running = 0.0
        for step, batch in enumerate(train_dl):
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            running += loss.detach().float()
            if accelerator.sync_gradients:
                global_step += 1
                if global_step % 50 == 0:
                    avg = accelerator.reduce(running / 50 / args.grad_accum, reduction="mean").item()
                    accelerator.log({"train/loss": avg, "lr": lr_scheduler.get_last_lr()[0]}, step=global_step)
                    running = 0.0

        # ---- validation: generate with the unwrapped model, pad across ranks, gather ----
        model.eval()
        unwrapped = accelerator.unwrap_model(model)
        preds_all, refs_all = [], []
        for batch in val_dl:
            with torch.no_grad():
                gen = unwrapped.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                         num_beams=args.num_beams, max_new_tokens=args.max_target_length)
            gen = accelerator.pad_across_processes(gen, dim=1, pad_index=tokenizer.pad_token_id)
            labels = accelerator.pad_across_processes(batch["labels"], dim=1, pad_index=-100)
            gen, labels = accelerator.gather_for_metrics((gen, labels))
            labels = torch.where(labels != -100, labels, tokenizer.pad_token_id)
            preds_all += tokenizer.batch_decode(gen.cpu().numpy(), skip_special_tokens=True)
            refs_all += tokenizer.batch_decode(labels.cpu().numpy(), skip_special_tokens=True)

        preds_all, refs_all = postprocess(preds_all, refs_all)
        scores = rouge.compute(predictions=preds_all, references=refs_all, use_stemmer=True)
        scores = {k: round(v * 100, 2) for k, v in scores.items()}
        logger.info(f"epoch {epoch}: n={len(preds_all)} {scores}", main_process_only=True)
        accelerator.log({f"val/{k}": v for k, v in scores.items()}, step=global_step)

        # every process holds the same gathered predictions, so this decision is identical on all ranks
        if scores["rougeL"] > best_rougeL:
            best_rougeL, bad_epochs = scores["rougeL"], 0
            accelerator.wait_for_everyone()
            unwrapped.save_pretrained(os.path.join(args.output_dir, "best"),
                                      is_main_process=accelerator.is_main_process,
                                      save_function=accelerator.save)
            if accelerator.is_main_process:
                tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))
        else:
            bad_epochs += 1

        ckpt_dir = os.path.join(args.output_dir, f"epoch_{epoch}")
        accelerator.save_state(ckpt_dir)
        if accelerator.is_main_process:
            with open(os.path.join(ckpt_dir, "trainer_meta.json"), "w") as f:
                json.dump({"epoch": epoch, "best_rougeL": best_rougeL, "bad_epochs": bad_epochs}, f)

        if bad_epochs >= args.patience:
            logger.info(f"early stopping at epoch {epoch}, best rougeL {best_rougeL}", main_process_only=True)
            break

    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
