"""Intent classification for the voice assistant logs (RoBERTa-base + Accelerate).

    accelerate launch --multi_gpu --num_machines 2 --num_processes 16 \
        --machine_rank $NODE_RANK --main_process_ip $HEAD_IP --main_process_port 29500 \
        --mixed_precision bf16 \
        06_intent_clf_accelerate_cache.py --data_dir /nfs/datasets/intents --cache_dir /nfs/cache/intents
"""
import argparse
import json
import math
import os

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import ClassLabel, DatasetDict, load_dataset, load_from_disk
from torch.utils.data import DataLoader
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                          get_cosine_schedule_with_warmup)

logger = get_logger(__name__)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--cache_dir", required=True)
    ap.add_argument("--output_dir", default="/nfs/runs/intents")
    ap.add_argument("--model", default="roberta-base")
    ap.add_argument("--max_len", type=int, default=64)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--grad_accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=4e-5, help="tuned for the 16-process global batch of 1024")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--warmup", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


def prepare_features(args, tokenizer):
    cache_path = os.path.join(args.cache_dir, f"{args.model.replace('/', '_')}_len{args.max_len}")
    if os.path.isdir(cache_path):
        return load_from_disk(cache_path)

    raw = load_dataset("json", data_files={
        "train": os.path.join(args.data_dir, "train.jsonl"),
        "validation": os.path.join(args.data_dir, "dev.jsonl"),
        "test": os.path.join(args.data_dir, "test.jsonl"),
    })
    raw = raw.filter(lambda ex: ex["utterance"] is not None and len(ex["utterance"].strip()) > 0)
    raw = raw.map(lambda ex: {"utterance": " ".join(ex["utterance"].split())})
    intents = sorted(set(raw["train"]["intent"]))
    raw = raw.filter(lambda ex: ex["intent"] in intents)  # drop intents only seen in dev/test
    raw = raw.cast_column("intent", ClassLabel(names=intents))

    def tok(batch):
        enc = tokenizer(batch["utterance"], truncation=True, max_length=args.max_len)
        enc["labels"] = batch["intent"]
        return enc

    feats = raw.map(tok, batched=True, num_proc=8, remove_columns=raw["train"].column_names)
    os.makedirs(args.cache_dir, exist_ok=True)
    feats.save_to_disk(cache_path)
    with open(cache_path + ".labels.json", "w") as f:
        json.dump(intents, f)
    return feats


def evaluate(model, loader, accelerator):
    model.eval()
    preds, refs = [], []
    for batch in loader:
        with torch.no_grad():
            logits = model(**batch).logits
        p, r = accelerator.gather_for_metrics((logits.argmax(-1), batch["labels"]))
        preds.append(p.cpu().numpy())
        refs.append(r.cpu().numpy())
    preds, refs = np.concatenate(preds), np.concatenate(refs)
    acc = float((preds == refs).mean())
    # macro-F1 over classes that occur in the references
    f1s = []
    for c in np.unique(refs):
        tp = np.sum((preds == c) & (refs == c))
        fp = np.sum((preds == c) & (refs != c))
        fn = np.sum((preds != c) & (refs == c))
        f1s.append(2 * tp / max(2 * tp + fp + fn, 1))
    return {"accuracy": acc, "macro_f1": float(np.mean(f1s))}


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, log_with="tensorboard",
                              project_dir=args.output_dir)
    set_seed(args.seed)
    accelerator.init_trackers("intent_clf", config=vars(args))

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    feats = prepare_features(args, tokenizer)
    num_labels = feats["train"].features["labels"].num_classes
    logger.info(f"train={len(feats['train'])} dev={len(feats['validation'])} labels={num_labels}",
                main_process_only=True)

    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    train_dl = DataLoader(feats["train"], batch_size=args.batch_size, shuffle=True, collate_fn=collator,
                          num_workers=4)
    dev_dl = DataLoader(feats["validation"], batch_size=256, collate_fn=collator)
    test_dl = DataLoader(feats["test"], batch_size=256, collate_fn=collator)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=num_labels)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, optimizer, train_dl, dev_dl, test_dl = accelerator.prepare(model, optimizer, train_dl, dev_dl, test_dl)

    steps_per_epoch = math.ceil(len(train_dl) / args.grad_accum)
    total = steps_per_epoch * args.epochs
    # stepped once per optimizer update below, so it is left outside accelerator.prepare
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup * total), total)

    best_f1, global_step = -1.0, 0
    for epoch in range(args.epochs):
        model.train()
        for batch in train_dl:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                if accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                global_step += 1
                if global_step % 50 == 0:
                    accelerator.log({"train/loss": loss.item(), "lr": scheduler.get_last_lr()[0]}, step=global_step)

        metrics = evaluate(model, dev_dl, accelerator)
        accelerator.log({f"dev/{k}": v for k, v in metrics.items()}, step=global_step)
        logger.info(f"epoch {epoch}: {metrics}", main_process_only=True)
        if metrics["macro_f1"] > best_f1:
            best_f1 = metrics["macro_f1"]
            accelerator.wait_for_everyone()
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.save_pretrained(os.path.join(args.output_dir, "best"), is_main_process=accelerator.is_main_process,
                                      save_function=accelerator.save)
            if accelerator.is_main_process:
                tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))

    test_metrics = evaluate(model, test_dl, accelerator)
    logger.info(f"test (last epoch): {test_metrics}", main_process_only=True)
    if accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "results.json"), "w") as f:
            json.dump({"best_dev_macro_f1": best_f1, "test_last": test_metrics}, f, indent=2)
    accelerator.end_training()


if __name__ == "__main__":
    main()
