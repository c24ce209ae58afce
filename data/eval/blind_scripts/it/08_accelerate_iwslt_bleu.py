#!/usr/bin/env python
# coding=utf-8
"""Fine-tune a MarianMT checkpoint on IWSLT2017 De->En with Accelerate.

    accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 \
        08_accelerate_iwslt_bleu.py --output_dir out/iwslt17-deen
"""
import argparse
import math
import os

import sacrebleu
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import (AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq,
                          get_scheduler)

logger = get_logger(__name__)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name_or_path", default="Helsinki-NLP/opus-mt-de-en")
    parser.add_argument("--dataset_config", default="iwslt2017-de-en")
    parser.add_argument("--source_lang", default="de")
    parser.add_argument("--target_lang", default="en")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=32)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=64)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--learning_rate", type=float, default=3e-5)
    parser.add_argument("--num_train_epochs", type=int, default=4)
    parser.add_argument("--num_warmup_steps", type=int, default=500)
    parser.add_argument("--max_source_length", type=int, default=200)
    parser.add_argument("--max_target_length", type=int, default=200)
    parser.add_argument("--num_beams", type=int, default=4)
    parser.add_argument("--preprocessing_num_workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              log_with="tensorboard", project_dir=args.output_dir)
    set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    raw = load_dataset("iwslt2017", args.dataset_config)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model_name_or_path)

    def preprocess(examples):
        inputs = [ex[args.source_lang] for ex in examples["translation"]]
        targets = [ex[args.target_lang] for ex in examples["translation"]]
        model_inputs = tokenizer(inputs, max_length=args.max_source_length, truncation=True)
        labels = tokenizer(text_target=targets, max_length=args.max_target_length, truncation=True)
        model_inputs["labels"] = labels["input_ids"]
        return model_inputs

    with accelerator.main_process_first():
        processed = raw.map(preprocess, batched=True, num_proc=args.preprocessing_num_workers,
                            remove_columns=raw["train"].column_names, desc="Tokenizing")
    train_dataset, eval_dataset = processed["train"], processed["validation"]

    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100,
                                      pad_to_multiple_of=8)
    train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=collator,
                                  batch_size=args.per_device_train_batch_size, num_workers=2)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=collator,
                                 batch_size=args.per_device_eval_batch_size)

    decay = [p for n, p in model.named_parameters() if not any(k in n for k in ("bias", "layer_norm"))]
    no_decay = [p for n, p in model.named_parameters() if any(k in n for k in ("bias", "layer_norm"))]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.learning_rate)

    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader)

    updates_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    max_train_steps = args.num_train_epochs * updates_per_epoch
    lr_scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=args.num_warmup_steps,
                                 num_training_steps=max_train_steps)
    lr_scheduler = accelerator.prepare(lr_scheduler)
    accelerator.init_trackers("iwslt17_deen", config=vars(args))

    total_batch = (args.per_device_train_batch_size * accelerator.num_processes
                   * args.gradient_accumulation_steps)
    logger.info(f"  Num examples = {len(train_dataset)}")
    logger.info(f"  Total train batch size = {total_batch}")
    logger.info(f"  Total optimization steps = {max_train_steps}")

    progress = tqdm(range(max_train_steps), disable=not accelerator.is_local_main_process)
    completed_steps = 0
    best_bleu = 0.0

    for epoch in range(args.num_train_epochs):
        model.train()
        total_loss = 0.0
        for step, batch in enumerate(train_dataloader):
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                total_loss += loss.detach().float()
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                progress.update(1)
                completed_steps += 1

        model.eval()
        unwrapped = accelerator.unwrap_model(model)
        predictions, references = [], []
        for batch in tqdm(eval_dataloader, disable=not accelerator.is_local_main_process, desc="eval"):
            with torch.no_grad():
                generated = unwrapped.generate(batch["input_ids"], attention_mask=batch["attention_mask"],
                                               num_beams=args.num_beams,
                                               max_length=args.max_target_length)
            labels = batch["labels"]
            labels = torch.where(labels != -100, labels, tokenizer.pad_token_id)
            predictions.extend(tokenizer.batch_decode(generated, skip_special_tokens=True))
            references.extend(tokenizer.batch_decode(labels, skip_special_tokens=True))

        bleu = sacrebleu.corpus_bleu(predictions, [references]).score
        chrf = sacrebleu.corpus_chrf(predictions, [references]).score
        train_loss = accelerator.gather(total_loss.reshape(1)).mean().item() / len(train_dataloader)
        logger.info(f"epoch {epoch}: train_loss {train_loss:.4f} BLEU {bleu:.2f} chrF {chrf:.2f}")
        accelerator.log({"bleu": bleu, "chrf": chrf, "train_loss": train_loss, "epoch": epoch},
                        step=completed_steps)

        accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))
        if bleu > best_bleu:
            best_bleu = bleu
            if accelerator.is_main_process:
                unwrapped.save_pretrained(os.path.join(args.output_dir, "best"),
                                          save_function=accelerator.save)
                tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))
                with open(os.path.join(args.output_dir, "best", "dev_scores.txt"), "w") as f:
                    f.write(f"epoch={epoch}\tBLEU={bleu:.2f}\tchrF={chrf:.2f}\n")

    accelerator.wait_for_everyone()
    accelerator.end_training()
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(os.path.join(args.output_dir, "last"), save_function=accelerator.save)
        tokenizer.save_pretrained(os.path.join(args.output_dir, "last"))


if __name__ == "__main__":
    main()
