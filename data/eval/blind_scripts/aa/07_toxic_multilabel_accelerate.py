"""Multi-label toxicity classifier (DeBERTa-v3-small) with HF Accelerate.

    accelerate launch --num_processes 4 --mixed_precision fp16 07_toxic_multilabel_accelerate.py \
        --train_csv data/jigsaw/train.csv --output_dir runs/toxic_deberta
"""
import argparse
import json
import os
import re

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import load_dataset
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, get_scheduler

LABELS = ["toxic", "severe_toxic", "obscene", "threat", "insult", "identity_hate"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train_csv", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--model", default="microsoft/deberta-v3-small")
    p.add_argument("--max_length", type=int, default=256)
    p.add_argument("--per_device_bs", type=int, default=16)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-5, help="for 4 processes x 16 x 4 accum = 256")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--patience", type=int, default=2)
    p.add_argument("--val_size", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


URL_RE = re.compile(r"https?://\S+")


def normalize(batch):
    return {"comment_text": [URL_RE.sub(" URL ", t).replace("\n", " ").strip() for t in batch["comment_text"]]}


def main():
    args = get_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.accum)
    set_seed(args.seed)
    is_main = accelerator.is_main_process

    tokenizer = AutoTokenizer.from_pretrained(args.model)

    def encode(batch):
        enc = tokenizer(batch["comment_text"], truncation=True, max_length=args.max_length)
        enc["labels"] = [[float(batch[l][i]) for l in LABELS] for i in range(len(batch["comment_text"]))]
        return enc

    # the main process fills the datasets cache first; the others then just read it
    with accelerator.main_process_first():
        raw = load_dataset("csv", data_files=args.train_csv, split="train")
        raw = raw.filter(lambda ex: ex["comment_text"] is not None and len(ex["comment_text"]) > 3)
        raw = raw.map(normalize, batched=True, num_proc=8)
        splits = raw.train_test_split(test_size=args.val_size, seed=args.seed)
        cols = splits["train"].column_names
        train_ds = splits["train"].map(encode, batched=True, num_proc=8, remove_columns=cols)
        val_ds = splits["test"].map(encode, batched=True, num_proc=8, remove_columns=cols)

    # rare labels get up-weighted; computed from the (identical) training split on every process
    label_mat = np.array(train_ds["labels"])
    pos = label_mat.sum(0)
    pos_weight = torch.tensor(np.clip((len(label_mat) - pos) / np.maximum(pos, 1), 1.0, 50.0), dtype=torch.float32)

    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    train_dl = DataLoader(train_ds, batch_size=args.per_device_bs, shuffle=True, collate_fn=collator, num_workers=4)
    val_dl = DataLoader(val_ds, batch_size=64, shuffle=False, collate_fn=collator, num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(
        args.model, num_labels=len(LABELS), problem_type="multi_label_classification")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, optimizer, train_dl, val_dl = accelerator.prepare(model, optimizer, train_dl, val_dl)
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=pos_weight.to(accelerator.device))

    updates_per_epoch = len(train_dl) // args.accum
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=int(0.05 * updates_per_epoch * args.epochs),
                              num_training_steps=updates_per_epoch * args.epochs)
    accelerator.register_for_checkpointing(scheduler)

    state_dir = os.path.join(args.output_dir, "state")
    progress_file = os.path.join(args.output_dir, "progress.json")
    progress = {"epoch": -1, "best_auc": 0.0, "bad_epochs": 0}
    if args.resume and os.path.exists(progress_file):
        accelerator.load_state(state_dir)
        with open(progress_file) as f:
            progress = json.load(f)
        accelerator.print(f"resuming after epoch {progress['epoch']}")

    for epoch in range(progress["epoch"] + 1, args.epochs):
        model.train()
        running, n = 0.0, 0
        for batch in train_dl:
            labels = batch.pop("labels")
            with accelerator.accumulate(model):
                logits = model(**batch).logits
                loss = loss_fn(logits.float(), labels)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                if accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad()
            running += loss.item()
            n += 1

        model.eval()
        all_probs, all_labels = [], []
        for batch in val_dl:
            labels = batch.pop("labels")
            with torch.no_grad():
                probs = torch.sigmoid(model(**batch).logits.float())
            probs, labels = accelerator.gather_for_metrics((probs, labels))
            all_probs.append(probs.cpu().numpy())
            all_labels.append(labels.cpu().numpy())
        probs, labels = np.concatenate(all_probs), np.concatenate(all_labels)
        aucs = [roc_auc_score(labels[:, j], probs[:, j]) for j in range(len(LABELS)) if 0 < labels[:, j].sum() < len(labels)]
        mean_auc = float(np.mean(aucs))
        train_loss = accelerator.reduce(torch.tensor(running / max(n, 1), device=accelerator.device), "mean").item()
        accelerator.print(f"epoch {epoch} train_loss {train_loss:.4f} val_mean_auc {mean_auc:.4f}")

        # every process computed the same AUC from the gathered predictions, so they all stop together
        if mean_auc > progress["best_auc"]:
            progress["best_auc"], progress["bad_epochs"] = mean_auc, 0
            accelerator.wait_for_everyone()
            accelerator.unwrap_model(model).save_pretrained(
                os.path.join(args.output_dir, "best"), is_main_process=is_main, save_function=accelerator.save)
            if is_main:
                tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))
        else:
            progress["bad_epochs"] += 1

        progress["epoch"] = epoch
        accelerator.save_state(state_dir)
        if is_main:
            with open(progress_file, "w") as f:
                json.dump(progress, f)
        accelerator.wait_for_everyone()
        if progress["bad_epochs"] >= args.patience:
            accelerator.print(f"no improvement for {args.patience} epochs, stopping")
            break

    accelerator.end_training()


if __name__ == "__main__":
    main()
