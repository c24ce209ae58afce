"""Clause extraction on CUAD framed as BIO tagging over sliding windows.

    accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 \
        02_cuad_clause_spans.py --data_dir data/cuad_bio --output_dir runs/cuad_bio
"""
import argparse
import json
import math
import os

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm
from transformers import (
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    get_linear_schedule_with_warmup,
)

logger = get_logger(__name__)


def parse_args():
    parser = argparse.ArgumentParser(description="CUAD clause tagging")
    parser.add_argument("--model_name", default="nlpaueb/legal-bert-base-uncased")
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_seq_length", type=int, default=512)
    parser.add_argument("--doc_stride", type=int, default=128)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=16)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=3e-5)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--num_train_epochs", type=int, default=4)
    parser.add_argument("--warmup_ratio", type=float, default=0.1)
    parser.add_argument("--checkpointing_steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def load_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def read_label_list(data_dir):
    with open(os.path.join(data_dir, "clause_types.json")) as f:
        types = json.load(f)
    return ["O"] + [f"{p}-{t}" for t in types for p in ("B", "I")]


class WindowedTaggingDataset(Dataset):
    """Splits each contract (pre-tokenised into words) into overlapping windows."""

    def __init__(self, docs, tokenizer, label2id, max_len, stride):
        self.features = []
        for doc in docs:
            enc = tokenizer(
                doc["tokens"],
                is_split_into_words=True,
                truncation=True,
                max_length=max_len,
                stride=stride,
                return_overflowing_tokens=True,
            )
            for w in range(len(enc["input_ids"])):
                labels, prev = [], None
                for wid in enc.word_ids(w):
                    if wid is None or wid == prev:
                        labels.append(-100)
                    else:
                        labels.append(label2id[doc["tags"][wid]])
                    prev = wid
                self.features.append({
                    "input_ids": enc["input_ids"][w],
                    "attention_mask": enc["attention_mask"][w],
                    "labels": labels,
                })

    def __len__(self):
        return len(self.features)

    def __getitem__(self, i):
        return self.features[i]


def bio_spans(tags):
    spans = set()
    start, cur = None, None
    for i, tag in enumerate(list(tags) + ["O"]):
        prefix, _, typ = tag.partition("-")
        if cur is not None and (prefix != "I" or typ != cur):
            spans.add((start, i, cur))
            cur = None
        if prefix == "B" or (prefix == "I" and cur is None):
            start, cur = i, typ
    return spans


def evaluate(model, loader, id2label, accelerator):
    model.eval()
    tp = fp = fn = 0
    for batch in tqdm(loader, disable=not accelerator.is_local_main_process, desc="eval"):
        with torch.no_grad():
            logits = model(**batch).logits
        preds = logits.argmax(-1).cpu().numpy()
        gold = batch["labels"].cpu().numpy()
        for p_row, g_row in zip(preds, gold):
            keep = g_row != -100
            p_spans = bio_spans([id2label[x] for x in p_row[keep]])
            g_spans = bio_spans([id2label[x] for x in g_row[keep]])
            tp += len(p_spans & g_spans)
            fp += len(p_spans - g_spans)
            fn += len(g_spans - p_spans)
    precision = tp / max(tp + fp, 1)
    recall = tp / max(tp + fn, 1)
    f1 = 2 * precision * recall / max(precision + recall, 1e-8)
    model.train()
    return {"span_precision": precision, "span_recall": recall, "span_f1": f1}


def main():
    args = parse_args()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with="tensorboard",
        project_dir=args.output_dir,
    )
    set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    label_list = read_label_list(args.data_dir)
    label2id = {l: i for i, l in enumerate(label_list)}
    id2label = {i: l for l, i in label2id.items()}

    tokenizer = AutoTokenizer.from_pretrained(args.model_name, use_fast=True)
    model = AutoModelForTokenClassification.from_pretrained(
        args.model_name, num_labels=len(label_list), id2label=id2label, label2id=label2id
    )

    with accelerator.main_process_first():
        train_ds = WindowedTaggingDataset(load_jsonl(os.path.join(args.data_dir, "train.jsonl")),
                                          tokenizer, label2id, args.max_seq_length, args.doc_stride)
        dev_ds = WindowedTaggingDataset(load_jsonl(os.path.join(args.data_dir, "dev.jsonl")),
                                        tokenizer, label2id, args.max_seq_length, args.doc_stride)

    collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8)
    train_loader = DataLoader(train_ds, shuffle=True, batch_size=args.per_device_train_batch_size,
                              collate_fn=collator, num_workers=2)
    dev_loader = DataLoader(dev_ds, batch_size=args.per_device_eval_batch_size,
                            collate_fn=collator, num_workers=2)

    no_decay = ["bias", "LayerNorm.weight"]
    optimizer = torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ], lr=args.learning_rate)

    # counted on the unsharded loader: the prepared scheduler steps once per process
    num_update_steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer, int(args.warmup_ratio * max_train_steps), max_train_steps
    )

    model, optimizer, train_loader, dev_loader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_loader, dev_loader, lr_scheduler
    )
    accelerator.init_trackers("cuad_bio", config=vars(args))

    completed_steps = 0
    best_f1 = 0.0
    progress = tqdm(total=math.ceil(len(train_loader) / args.gradient_accumulation_steps) * args.num_train_epochs,
                    disable=not accelerator.is_local_main_process)
    for epoch in range(args.num_train_epochs):
        model.train()
        running = 0.0
        for batch in train_loader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            running += loss.item()

            if accelerator.sync_gradients:
                completed_steps += 1
                progress.update(1)
                if completed_steps % 50 == 0:
                    accelerator.log({"train_loss": running / (50 * args.gradient_accumulation_steps),
                                     "lr": lr_scheduler.get_last_lr()[0]}, step=completed_steps)
                    running = 0.0
                if completed_steps % args.checkpointing_steps == 0:
                    accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))

        metrics = evaluate(model, dev_loader, id2label, accelerator)
        logger.info(f"epoch {epoch}: {metrics}", main_process_only=True)
        accelerator.log(metrics, step=completed_steps)

        accelerator.wait_for_everyone()
        if accelerator.is_main_process and metrics["span_f1"] > best_f1:
            best_f1 = metrics["span_f1"]
            best_dir = os.path.join(args.output_dir, "best")
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.save_pretrained(best_dir, save_function=accelerator.save)
            tokenizer.save_pretrained(best_dir)
            with open(os.path.join(best_dir, "dev_metrics.json"), "w") as f:
                json.dump({"epoch": epoch, **metrics}, f, indent=2)

    accelerator.end_training()


if __name__ == "__main__":
    main()
