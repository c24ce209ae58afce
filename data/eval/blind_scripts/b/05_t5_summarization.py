#!/usr/bin/env python
# Fine-tune t5-base on CNN/DailyMail with accelerate; ROUGE on the validation split each epoch.
#
#   accelerate launch --multi_gpu --num_processes 4 05_t5_summarization.py \
#       --model_name t5-base --output_dir ./t5-cnn --num_epochs 3
import argparse
import logging
import math
import os

import evaluate
import nltk
import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    get_scheduler,
)

logging.basicConfig(level=logging.INFO)
logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name", default="t5-base")
    parser.add_argument("--output_dir", default="./t5-cnn")
    parser.add_argument("--max_source_length", type=int, default=512)
    parser.add_argument("--max_target_length", type=int, default=128)
    parser.add_argument("--train_batch_size", type=int, default=8)
    parser.add_argument("--eval_batch_size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--num_epochs", type=int, default=3)
    parser.add_argument("--num_beams", type=int, default=4)
    parser.add_argument("--max_eval_samples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def postprocess_text(preds, labels):
    preds = [pred.strip() for pred in preds]
    labels = [label.strip() for label in labels]
    # rougeLSum expects newline after each sentence
    preds = ["\n".join(nltk.sent_tokenize(pred)) for pred in preds]
    labels = ["\n".join(nltk.sent_tokenize(label)) for label in labels]
    return preds, labels


def main():
    args = parse_args()
    accelerator = Accelerator(mixed_precision="bf16")
    set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        nltk.download("punkt", quiet=True)
    accelerator.wait_for_everyone()

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model_name)

    raw = load_dataset("cnn_dailymail", "3.0.0")
    raw["validation"] = raw["validation"].select(range(args.max_eval_samples))
    prefix = "summarize: "

    def preprocess(batch):
        inputs = [prefix + doc for doc in batch["article"]]
        model_inputs = tokenizer(inputs, max_length=args.max_source_length, truncation=True)
        labels = tokenizer(text_target=batch["highlights"], max_length=args.max_target_length,
                           truncation=True)
        model_inputs["labels"] = labels["input_ids"]
        return model_inputs

    with accelerator.main_process_first():
        processed = raw.map(preprocess, batched=True, num_proc=8,
                            remove_columns=raw["train"].column_names)

    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100,
                                      pad_to_multiple_of=8)
    train_dl = DataLoader(processed["train"], shuffle=True, batch_size=args.train_batch_size,
                          collate_fn=collator, num_workers=4)
    eval_dl = DataLoader(processed["validation"], batch_size=args.eval_batch_size,
                         collate_fn=collator, num_workers=4)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    num_training_steps = args.num_epochs * math.ceil(len(train_dl) / accelerator.num_processes)
    lr_scheduler = get_scheduler("linear", optimizer=optimizer,
                                 num_warmup_steps=500 * accelerator.num_processes,
                                 num_training_steps=num_training_steps * accelerator.num_processes)

    model, optimizer, train_dl, eval_dl, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, lr_scheduler
    )

    rouge = evaluate.load("rouge")
    progress = tqdm(range(num_training_steps), disable=not accelerator.is_local_main_process)
    best_rouge = -1.0

    for epoch in range(args.num_epochs):
        model.train()
        for step, batch in enumerate(train_dl):
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            progress.update(1)
            if step % 100 == 0:
                accelerator.print(f"epoch {epoch} step {step} loss {loss.item():.4f}")

        model.eval()
        gen_kwargs = {"max_length": args.max_target_length, "num_beams": args.num_beams}
        for batch in tqdm(eval_dl, disable=not accelerator.is_local_main_process):
            with torch.no_grad():
                generated_tokens = model.generate(
                    batch["input_ids"],
                    attention_mask=batch["attention_mask"],
                    **gen_kwargs,
                )
                generated_tokens = accelerator.pad_across_processes(
                    generated_tokens, dim=1, pad_index=tokenizer.pad_token_id
                )
                labels = accelerator.pad_across_processes(batch["labels"], dim=1, pad_index=-100)
                generated_tokens, labels = accelerator.gather_for_metrics((generated_tokens, labels))
                generated_tokens = generated_tokens.cpu().numpy()
                labels = labels.cpu().numpy()
                labels = np.where(labels != -100, labels, tokenizer.pad_token_id)

                decoded_preds = tokenizer.batch_decode(generated_tokens, skip_special_tokens=True)
                decoded_labels = tokenizer.batch_decode(labels, skip_special_tokens=True)
                decoded_preds, decoded_labels = postprocess_text(decoded_preds, decoded_labels)
                rouge.add_batch(predictions=decoded_preds, references=decoded_labels)

        result = rouge.compute(use_stemmer=True)
        result = {k: round(v * 100, 4) for k, v in result.items()}
        accelerator.print(f"epoch {epoch}: {result}")

        if result["rougeL"] > best_rouge:
            best_rouge = result["rougeL"]
            accelerator.wait_for_everyone()
            unwrapped_model = accelerator.unwrap_model(model)
            unwrapped_model.save_pretrained(args.output_dir,
                                            is_main_process=accelerator.is_main_process,
                                            save_function=accelerator.save)
            if accelerator.is_main_process:
                tokenizer.save_pretrained(args.output_dir)

    accelerator.end_training()


if __name__ == "__main__":
    main()
