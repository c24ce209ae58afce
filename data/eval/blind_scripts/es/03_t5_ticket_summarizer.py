"""Summarise support tickets with flan-t5.

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 \
        03_t5_ticket_summarizer.py --train_file data/tickets_train.jsonl --val_file data/tickets_val.jsonl
"""
import argparse
import logging
import math
import os

import datasets
import evaluate
import nltk
import numpy as np
import torch
import transformers
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import ProjectConfiguration, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    get_cosine_schedule_with_warmup,
)

logger = get_logger(__name__)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--val_file", required=True)
    parser.add_argument("--model_name_or_path", default="google/flan-t5-base")
    parser.add_argument("--output_dir", default="runs/ticket_t5")
    parser.add_argument("--source_prefix", default="summarize: ")
    parser.add_argument("--max_source_length", type=int, default=768)
    parser.add_argument("--max_target_length", type=int, default=96)
    parser.add_argument("--num_beams", type=int, default=4)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=16)
    parser.add_argument("--learning_rate", type=float, default=3e-4)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--num_train_epochs", type=int, default=4)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--num_warmup_steps", type=int, default=500)
    parser.add_argument("--checkpointing_steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--with_tracking", action="store_true")
    return parser.parse_args()


def postprocess_text(preds, labels):
    preds = ["\n".join(nltk.sent_tokenize(p.strip())) for p in preds]
    labels = ["\n".join(nltk.sent_tokenize(l.strip())) for l in labels]
    return preds, labels


def main():
    args = parse_args()
    project_config = ProjectConfiguration(project_dir=args.output_dir, automatic_checkpoint_naming=True,
                                          total_limit=3)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with="tensorboard" if args.with_tracking else None,
        project_config=project_config,
    )
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    if accelerator.is_local_main_process:
        datasets.utils.logging.set_verbosity_warning()
        transformers.utils.logging.set_verbosity_info()
        nltk.download("punkt", quiet=True)
    else:
        datasets.utils.logging.set_verbosity_error()
        transformers.utils.logging.set_verbosity_error()
    accelerator.wait_for_everyone()
    set_seed(args.seed)

    raw = datasets.load_dataset("json", data_files={"train": args.train_file, "validation": args.val_file})
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model_name_or_path)

    def preprocess(examples):
        inputs = [args.source_prefix + t for t in examples["ticket_body"]]
        model_inputs = tokenizer(inputs, max_length=args.max_source_length, truncation=True)
        labels = tokenizer(text_target=examples["agent_summary"], max_length=args.max_target_length,
                           truncation=True)
        model_inputs["labels"] = labels["input_ids"]
        return model_inputs

    with accelerator.main_process_first():
        processed = raw.map(preprocess, batched=True, num_proc=8,
                            remove_columns=raw["train"].column_names, desc="tokenizing")

    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100,
                                      pad_to_multiple_of=8)
    train_loader = DataLoader(processed["train"], shuffle=True, collate_fn=collator,
                              batch_size=args.per_device_train_batch_size)
    eval_loader = DataLoader(processed["validation"], collate_fn=collator,
                             batch_size=args.per_device_eval_batch_size)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    updates_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    max_train_steps = args.num_train_epochs * updates_per_epoch
    lr_scheduler = get_cosine_schedule_with_warmup(
        optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=max_train_steps,
    )

    model, optimizer, train_loader, eval_loader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, lr_scheduler
    )
    updates_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    max_train_steps = args.num_train_epochs * updates_per_epoch

    if args.with_tracking:
        accelerator.init_trackers("ticket_summarizer", vars(args))

    rouge = evaluate.load("rouge")
    progress = tqdm(range(max_train_steps), disable=not accelerator.is_local_main_process)
    completed_steps = 0

    for epoch in range(args.num_train_epochs):
        model.train()
        total_loss = 0.0
        for batch in train_loader:
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
                if completed_steps % args.checkpointing_steps == 0:
                    accelerator.save_state()

        model.eval()
        gen_kwargs = {"max_length": args.max_target_length, "num_beams": args.num_beams}
        for batch in tqdm(eval_loader, disable=not accelerator.is_local_main_process, desc="eval"):
            with torch.no_grad():
                generated = model.generate(
                    input_ids=batch["input_ids"],
                    attention_mask=batch["attention_mask"],
                    **gen_kwargs,
                )
            generated = accelerator.pad_across_processes(generated, dim=1, pad_index=tokenizer.pad_token_id)
            labels = accelerator.pad_across_processes(batch["labels"], dim=1, pad_index=tokenizer.pad_token_id)
            generated, labels = accelerator.gather_for_metrics((generated, labels))
            generated = generated.cpu().numpy()
            labels = labels.cpu().numpy()
            labels = np.where(labels != -100, labels, tokenizer.pad_token_id)
            decoded_preds = tokenizer.batch_decode(generated, skip_special_tokens=True)
            decoded_labels = tokenizer.batch_decode(labels, skip_special_tokens=True)
            decoded_preds, decoded_labels = postprocess_text(decoded_preds, decoded_labels)
            rouge.add_batch(predictions=decoded_preds, references=decoded_labels)

        scores = rouge.compute(use_stemmer=True)
        scores = {k: round(v * 100, 2) for k, v in scores.items()}
        train_loss = accelerator.reduce(total_loss, reduction="mean").item() / len(train_loader)
        logger.info(f"epoch {epoch}: train_loss {train_loss:.4f} {scores}")
        if args.with_tracking:
            accelerator.log({**scores, "train_loss": train_loss, "epoch": epoch}, step=completed_steps)

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(os.path.join(args.output_dir, "final"),
                              is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
