#!/usr/bin/env python
"""Support-ticket intent classification (imbalanced, 23 classes).

Fine-tunes a DeBERTa-v3 encoder with the HF Trainer; class-weighted CE loss
+ label smoothing through a small Trainer subclass.

torchrun --nproc_per_node=4 03_textcls_hf_weighted_trainer.py \
    --train_file data/tickets_train.jsonl --eval_file data/tickets_dev.jsonl
"""
import argparse
import json
import logging
import os

import numpy as np
import torch
import torch.nn.functional as F
from datasets import load_dataset
from sklearn.metrics import accuracy_score, f1_score
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    EarlyStoppingCallback,
    Trainer,
    TrainingArguments,
    set_seed,
)

logger = logging.getLogger(__name__)
logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_name", default="microsoft/deberta-v3-base")
    ap.add_argument("--train_file", required=True)
    ap.add_argument("--eval_file", required=True)
    ap.add_argument("--label_file", default="data/labels.json")
    ap.add_argument("--output_dir", default="out/tickets-deberta")
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--epochs", type=float, default=4)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--smoothing", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


class WeightedLossTrainer(Trainer):
    def __init__(self, *args, class_weights=None, smoothing=0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.class_weights = class_weights
        self.smoothing = smoothing

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits
        w = self.class_weights.to(logits.device, dtype=logits.dtype) if self.class_weights is not None else None
        loss = F.cross_entropy(
            logits.view(-1, model.config.num_labels),
            labels.view(-1),
            weight=w,
            label_smoothing=self.smoothing,
        )
        return (loss, outputs) if return_outputs else loss


def compute_metrics(eval_pred):
    logits, labels = eval_pred
    preds = np.argmax(logits, axis=-1)
    return {
        "accuracy": accuracy_score(labels, preds),
        "macro_f1": f1_score(labels, preds, average="macro"),
        "weighted_f1": f1_score(labels, preds, average="weighted"),
    }


def inverse_freq_weights(labels, n_classes, power=0.5):
    counts = np.bincount(labels, minlength=n_classes).astype(np.float64)
    counts = np.maximum(counts, 1.0)
    w = (counts.sum() / counts) ** power
    w = w / w.mean()
    return torch.tensor(w, dtype=torch.float32)


def main():
    args = parse()
    set_seed(args.seed)

    with open(args.label_file) as f:
        label_list = json.load(f)
    label2id = {l: i for i, l in enumerate(label_list)}
    id2label = {i: l for l, i in label2id.items()}

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.bs,
        per_device_eval_batch_size=args.bs * 2,
        learning_rate=args.lr,
        num_train_epochs=args.epochs,
        warmup_ratio=0.06,
        weight_decay=0.01,
        lr_scheduler_type="linear",
        eval_strategy="steps",
        eval_steps=500,
        save_strategy="steps",
        save_steps=500,
        save_total_limit=3,
        load_best_model_at_end=True,
        metric_for_best_model="macro_f1",
        logging_steps=50,
        bf16=True,
        dataloader_num_workers=4,
        report_to=["tensorboard"],
        seed=args.seed,
    )

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    raw = load_dataset("json", data_files={"train": args.train_file, "validation": args.eval_file})

    def preprocess(batch):
        enc = tokenizer(batch["subject"], batch["body"], truncation=True, max_length=args.max_len)
        enc["labels"] = [label2id[l] for l in batch["intent"]]
        return enc

    with training_args.main_process_first(desc="tokenizing"):
        ds = raw.map(preprocess, batched=True, remove_columns=raw["train"].column_names)

    weights = inverse_freq_weights(np.array(ds["train"]["labels"]), len(label_list))
    logger.info("class weights: %s", weights.tolist())

    model = AutoModelForSequenceClassification.from_pretrained(
        args.model_name, num_labels=len(label_list), id2label=id2label, label2id=label2id
    )

    trainer = WeightedLossTrainer(
        model=model,
        args=training_args,
        train_dataset=ds["train"],
        eval_dataset=ds["validation"],
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8),
        compute_metrics=compute_metrics,
        callbacks=[EarlyStoppingCallback(early_stopping_patience=4)],
        class_weights=weights,
        smoothing=args.smoothing,
    )
    trainer.train()
    metrics = trainer.evaluate()
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)
    trainer.save_model(os.path.join(args.output_dir, "best"))
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))


if __name__ == "__main__":
    main()
