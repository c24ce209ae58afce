"""
Fine-tune bert-base-uncased on GLUE/SST-2 with Hugging Face Accelerate.

    accelerate config        # pick multi-GPU, 4 processes, bf16
    accelerate launch 03_bert_sst2_accelerate.py --num_epochs 3
"""
import argparse
import json
import math
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    get_linear_schedule_with_warmup,
)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name", default="bert-base-uncased")
    parser.add_argument("--output_dir", default="outputs/bert-sst2")
    parser.add_argument("--max_length", type=int, default=128)
    parser.add_argument("--train_batch_size", type=int, default=32)
    parser.add_argument("--eval_batch_size", type=int, default=64)
    parser.add_argument("--learning_rate", type=float, default=2e-5)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--num_epochs", type=int, default=3)
    parser.add_argument("--warmup_ratio", type=float, default=0.06)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def build_dataloaders(accelerator, tokenizer, args):
    raw = load_dataset("glue", "sst2")

    def tokenize(batch):
        return tokenizer(batch["sentence"], truncation=True, max_length=args.max_length)

    # main process tokenizes first and fills the datasets cache, the rest reuse it
    with accelerator.main_process_first():
        tokenized = raw.map(tokenize, batched=True, remove_columns=["sentence", "idx"])
    tokenized = tokenized.rename_column("label", "labels")

    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    train_dl = DataLoader(tokenized["train"], shuffle=True, batch_size=args.train_batch_size,
                          collate_fn=collator, num_workers=2)
    eval_dl = DataLoader(tokenized["validation"], shuffle=False, batch_size=args.eval_batch_size,
                         collate_fn=collator, num_workers=2)
    return train_dl, eval_dl


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)

    accelerator.print(f"num_processes={accelerator.num_processes} "
                      f"mixed_precision={accelerator.mixed_precision}")
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    model = AutoModelForSequenceClassification.from_pretrained(args.model_name, num_labels=2)

    train_dl, eval_dl = build_dataloaders(accelerator, tokenizer, args)

    no_decay = ["bias", "LayerNorm.weight"]
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.learning_rate)

    model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)

    # after prepare() len(train_dl) is the per-process length
    updates_per_epoch = math.ceil(len(train_dl) / args.gradient_accumulation_steps)
    max_train_steps = updates_per_epoch * args.num_epochs
    # the prepared scheduler is stepped once per process, so size it for all of them
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer,
        num_warmup_steps=int(args.warmup_ratio * max_train_steps) * accelerator.num_processes,
        num_training_steps=max_train_steps * accelerator.num_processes,
    )
    lr_scheduler = accelerator.prepare(lr_scheduler)

    best_acc = 0.0
    history = []
    progress = tqdm(range(max_train_steps), disable=not accelerator.is_local_main_process)

    for epoch in range(args.num_epochs):
        model.train()
        total_loss = 0.0
        for step, batch in enumerate(train_dl):
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            total_loss += loss.detach().float()
            if accelerator.sync_gradients:
                progress.update(1)
                progress.set_postfix(loss=loss.item())

        avg_train_loss = accelerator.reduce(total_loss, reduction="mean").item() / len(train_dl)

        # ---- eval ----
        model.eval()
        correct, total = 0, 0
        for batch in eval_dl:
            with torch.no_grad():
                logits = model(**batch).logits
            preds = logits.argmax(dim=-1)
            correct += (preds == batch["labels"]).sum().item()
            total += batch["labels"].size(0)
        val_acc = correct / total

        accelerator.print(f"epoch {epoch}: train_loss={avg_train_loss:.4f} val_acc={val_acc:.4f}")
        history.append({"epoch": epoch, "train_loss": avg_train_loss, "val_acc": val_acc})

        if accelerator.is_main_process and val_acc > best_acc:
            best_acc = val_acc
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.save_pretrained(os.path.join(args.output_dir, "best"), safe_serialization=True)
            tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))
            print(f"saved new best model (acc={best_acc:.4f})")

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(os.path.join(args.output_dir, "final"), safe_serialization=True)
        tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))
        with open(os.path.join(args.output_dir, "history.json"), "w") as f:
            json.dump(history, f, indent=2)
        print(f"best val acc: {best_acc:.4f}")

    accelerator.end_training()


if __name__ == "__main__":
    main()
