"""Multilingual e-commerce query classification (category taxonomy, 412 leaves)
with XLM-R large, HF Trainer + DeepSpeed ZeRO-2.

    deepspeed --num_gpus 4 20_textcls_hf_deepspeed_zero2.py --train data/queries_train.csv \
        --dev data/queries_dev.csv --out out/xlmr-queries
"""
import argparse
import json
import os

import numpy as np
import pandas as pd
import torch
from datasets import Dataset, DatasetDict
from sklearn.metrics import accuracy_score, f1_score
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

DS_CONFIG = {
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 2,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
        "allgather_bucket_size": 5e8,
    },
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto", "warmup_num_steps": "auto",
                   "total_num_steps": "auto"},
    },
    "gradient_clipping": 1.0,
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 1,
    "train_batch_size": 64,
    "steps_per_print": 200,
    "wall_clock_breakdown": False,
}


class PrintMetricsCallback(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "eval_macro_f1" in logs:
            print(f"[step {state.global_step}] eval acc={logs['eval_accuracy']:.4f} "
                  f"macro_f1={logs['eval_macro_f1']:.4f}")


def load_split(path, label2id):
    df = pd.read_csv(path)
    df = df[df["category"].isin(label2id)]
    return Dataset.from_dict({"text": df["query"].astype(str).tolist(),
                              "label": [label2id[c] for c in df["category"]]})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="xlm-roberta-large")
    ap.add_argument("--train", default="data/queries_train.csv")
    ap.add_argument("--dev", default="data/queries_dev.csv")
    ap.add_argument("--taxonomy", default="data/taxonomy_leaves.json")
    ap.add_argument("--out", default="out/xlmr-queries")
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--grad_accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1.5e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--max_len", type=int, default=64)
    ap.add_argument("--local_rank", type=int, default=-1)
    args = ap.parse_args()
    set_seed(1)

    leaves = json.load(open(args.taxonomy))
    label2id = {c: i for i, c in enumerate(leaves)}

    training_args = TrainingArguments(
        output_dir=args.out,
        per_device_train_batch_size=args.bs,
        per_device_eval_batch_size=128,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        num_train_epochs=args.epochs,
        warmup_ratio=0.05,
        weight_decay=0.01,
        bf16=True,
        eval_strategy="steps",
        eval_steps=1000,
        save_strategy="steps",
        save_steps=1000,
        save_total_limit=2,
        load_best_model_at_end=True,
        metric_for_best_model="macro_f1",
        logging_steps=100,
        report_to="none",
        deepspeed=DS_CONFIG,
        local_rank=args.local_rank,
    )

    tok = AutoTokenizer.from_pretrained(args.model)
    raw = DatasetDict({"train": load_split(args.train, label2id), "dev": load_split(args.dev, label2id)})
    with training_args.main_process_first(desc="tokenize"):
        ds = raw.map(lambda b: tok(b["text"], truncation=True, max_length=args.max_len),
                     batched=True, remove_columns=["text"])

    model = AutoModelForSequenceClassification.from_pretrained(
        args.model, num_labels=len(leaves), id2label=dict(enumerate(leaves)), label2id=label2id)

    def compute_metrics(p):
        preds = p.predictions.argmax(-1)
        return {"accuracy": accuracy_score(p.label_ids, preds),
                "macro_f1": f1_score(p.label_ids, preds, average="macro")}

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=ds["train"],
        eval_dataset=ds["dev"],
        processing_class=tok,
        data_collator=DataCollatorWithPadding(tok),
        compute_metrics=compute_metrics,
        callbacks=[PrintMetricsCallback()],
    )
    trainer.train()
    trainer.save_model(os.path.join(args.out, "final"))
    if trainer.is_world_process_zero():
        with open(os.path.join(args.out, "label_map.json"), "w") as f:
            json.dump(label2id, f)


if __name__ == "__main__":
    main()
