#!/usr/bin/env python
"""Fine-tune an encoder on the internal news-topic dataset.

The CSVs in --data_dir have columns: id, title, text, label.
labels.json holds the list of topic names.

    accelerate launch --multi_gpu --num_processes 4 01_news_topic_classifier.py \
        --data_dir /data/news_topics --output_dir runs/news_bert
"""
import argparse
import json
import logging
import math
import os
import time

import pandas as pd
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    get_linear_schedule_with_warmup,
)

logger = get_logger(__name__)


def parse_args():
    p = argparse.ArgumentParser(description="news topic classifier")
    p.add_argument("--data_dir", type=str, required=True)
    p.add_argument("--cache_dir", type=str, default=None, help="where tokenized features are kept")
    p.add_argument("--model_name", type=str, default="bert-base-uncased")
    p.add_argument("--output_dir", type=str, default="runs/news_topic")
    p.add_argument("--max_length", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=32, help="per device")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup_ratio", type=float, default=0.06)
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--mixed_precision", type=str, default="bf16", choices=["no", "fp16", "bf16"])
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--num_workers", type=int, default=4)
    return p.parse_args()


class EncodedDataset(Dataset):
    def __init__(self, encodings, labels):
        self.input_ids = encodings["input_ids"]
        self.attention_mask = encodings["attention_mask"]
        self.labels = labels

    def __len__(self):
        return self.labels.size(0)

    def __getitem__(self, idx):
        return {
            "input_ids": self.input_ids[idx],
            "attention_mask": self.attention_mask[idx],
            "labels": self.labels[idx],
        }


def load_split(csv_path, tokenizer, label2id, max_length, cache_dir):
    """Tokenize a split once and keep the tensors next to the data."""
    split = os.path.splitext(os.path.basename(csv_path))[0]
    tok_name = tokenizer.name_or_path.replace("/", "_")
    cache_file = os.path.join(cache_dir, f"{split}_{tok_name}_{max_length}.pt")
    if os.path.exists(cache_file):
        logger.info(f"loading cached features from {cache_file}")
        cached = torch.load(cache_file)
        return EncodedDataset(cached["encodings"], cached["labels"])

    logger.info(f"tokenizing {csv_path}")
    df = pd.read_csv(csv_path)
    df = df.dropna(subset=["text", "label"])
    texts = (df["title"].fillna("") + " . " + df["text"]).tolist()
    enc = tokenizer(texts, truncation=True, max_length=max_length, padding="max_length", return_tensors="pt")
    labels = torch.tensor([label2id[l] for l in df["label"]], dtype=torch.long)
    encodings = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    os.makedirs(cache_dir, exist_ok=True)
    torch.save({"encodings": encodings, "labels": labels}, cache_file)
    return EncodedDataset(encodings, labels)


def evaluate(model, loader, accelerator):
    model.eval()
    correct, seen, loss_sum = 0, 0, 0.0
    for batch in loader:
        with torch.no_grad():
            out = model(**batch)
        preds = out.logits.argmax(dim=-1)
        losses = accelerator.gather_for_metrics(out.loss.detach().repeat(batch["labels"].size(0)))
        preds, refs = accelerator.gather_for_metrics((preds, batch["labels"]))
        correct += (preds == refs).sum().item()
        seen += refs.numel()
        loss_sum += losses.sum().item()
    model.train()
    return {"val_acc": correct / max(seen, 1), "val_loss": loss_sum / max(seen, 1)}


def main():
    args = parse_args()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.grad_accum,
        mixed_precision=args.mixed_precision,
    )
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        level=logging.INFO,
    )
    logger.info(accelerator.state, main_process_only=False)
    set_seed(args.seed)

    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    with open(os.path.join(args.data_dir, "labels.json")) as f:
        topics = json.load(f)
    label2id = {name: i for i, name in enumerate(sorted(topics))}
    id2label = {i: name for name, i in label2id.items()}

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    cache_dir = args.cache_dir or os.path.join(args.data_dir, "features")
    train_ds = load_split(os.path.join(args.data_dir, "train.csv"), tokenizer, label2id, args.max_length, cache_dir)
    val_ds = load_split(os.path.join(args.data_dir, "dev.csv"), tokenizer, label2id, args.max_length, cache_dir)
    logger.info(f"train={len(train_ds)} dev={len(val_ds)} classes={len(label2id)}")

    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size * 2, shuffle=False,
                            num_workers=args.num_workers, pin_memory=True)

    model = AutoModelForSequenceClassification.from_pretrained(
        args.model_name, num_labels=len(label2id), id2label=id2label, label2id=label2id
    )
    no_decay = ["bias", "LayerNorm.weight"]
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.lr)

    # counted on the unsharded loader: the prepared scheduler advances once per process on each step
    total_steps = math.ceil(len(train_loader) / args.grad_accum) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, val_loader, scheduler
    )
    steps_per_epoch = math.ceil(len(train_loader) / args.grad_accum)

    world = dist.get_world_size() if dist.is_initialized() else 1
    logger.info(f"world size {world}, {steps_per_epoch} optimizer steps per epoch")

    best_acc = 0.0
    global_step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        running = torch.zeros((), device=accelerator.device)
        for step, batch in enumerate(train_loader):
            with accelerator.accumulate(model):
                out = model(**batch)
                loss = out.loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            running += loss.detach()
            if accelerator.sync_gradients:
                global_step += 1
                if global_step % args.log_every == 0:
                    avg = accelerator.reduce(running, reduction="mean") / args.log_every / args.grad_accum
                    running.zero_()
                    logger.info(
                        f"epoch {epoch} step {global_step} loss {avg.item():.4f} "
                        f"lr {scheduler.get_last_lr()[0]:.2e} {(time.time() - t0) / (step + 1):.3f}s/it"
                    )

        metrics = evaluate(model, val_loader, accelerator)
        logger.info(f"epoch {epoch}: {metrics}")
        accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))
        if metrics["val_acc"] > best_acc:
            best_acc = metrics["val_acc"]
            accelerator.wait_for_everyone()
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.save_pretrained(
                os.path.join(args.output_dir, "best"),
                is_main_process=accelerator.is_main_process,
                save_function=accelerator.save,
            )
            if accelerator.is_main_process:
                tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))

    logger.info(f"best dev accuracy {best_acc:.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
