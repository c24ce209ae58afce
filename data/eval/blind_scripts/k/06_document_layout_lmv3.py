"""Token classification for document layout / key-value entities (LayoutLMv3 on our FUNSD-style export).

    accelerate launch --config_file configs/accelerate_4gpu.yaml 06_document_layout_lmv3.py \
        --data_dir /mnt/datasets/forms_v3 --output_dir runs/lmv3_forms
"""
import argparse
import json
import logging
import math
import os

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import load_from_disk
from seqeval.metrics import classification_report, f1_score
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import (AutoModelForTokenClassification, AutoProcessor, default_data_collator,
                          get_cosine_schedule_with_warmup)

logger = get_logger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name", default="microsoft/layoutlmv3-base")
    p.add_argument("--data_dir", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--per_device_train_batch_size", type=int, default=4)
    p.add_argument("--per_device_eval_batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=4)
    p.add_argument("--learning_rate", type=float, default=3e-5)
    p.add_argument("--num_train_epochs", type=int, default=20)
    p.add_argument("--warmup_ratio", type=float, default=0.1)
    p.add_argument("--max_length", type=int, default=512)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--mixed_precision", default="bf16")
    return p.parse_args()


def build_features(dataset, processor, label2id, max_length):
    def encode(batch):
        images = [img.convert("RGB") for img in batch["image"]]
        enc = processor(images, batch["words"], boxes=batch["bboxes"],
                        word_labels=[[label2id[t] for t in tags] for tags in batch["ner_tags"]],
                        truncation=True, padding="max_length", max_length=max_length)
        return enc

    return dataset.map(encode, batched=True, batch_size=32, remove_columns=dataset.column_names)


def to_tag_sequences(pred_ids, label_ids, id2label):
    preds, refs = [], []
    for p_row, l_row in zip(pred_ids, label_ids):
        keep = l_row != -100
        preds.append([id2label[int(i)] for i in p_row[keep]])
        refs.append([id2label[int(i)] for i in l_row[keep]])
    return preds, refs


def evaluate(model, loader, accelerator, id2label):
    model.eval()
    all_preds, all_refs = [], []
    for batch in loader:
        with torch.no_grad():
            logits = model(**batch).logits
        pred_ids = logits.argmax(-1).cpu().numpy()
        label_ids = batch["labels"].cpu().numpy()
        p, r = to_tag_sequences(pred_ids, label_ids, id2label)
        all_preds.extend(p)
        all_refs.extend(r)
    model.train()
    return f1_score(all_refs, all_preds), classification_report(all_refs, all_preds, digits=4)


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              mixed_precision=args.mixed_precision, log_with="tensorboard",
                              project_dir=args.output_dir)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    logger.info(accelerator.state, main_process_only=False)
    set_seed(args.seed)

    raw = load_from_disk(args.data_dir)
    label_list = raw["train"].features["ner_tags"].feature.names
    label2id = {l: i for i, l in enumerate(label_list)}
    id2label = {i: l for l, i in label2id.items()}
    processor = AutoProcessor.from_pretrained(args.model_name, apply_ocr=False)

    with accelerator.main_process_first():
        train_ds = build_features(raw["train"], processor, label2id, args.max_length)
        eval_ds = build_features(raw["test"], processor, label2id, args.max_length)
    train_ds.set_format("torch")
    eval_ds.set_format("torch")

    train_loader = DataLoader(train_ds, shuffle=True, batch_size=args.per_device_train_batch_size,
                              collate_fn=default_data_collator, num_workers=4)
    eval_loader = DataLoader(eval_ds, batch_size=args.per_device_eval_batch_size,
                             collate_fn=default_data_collator, num_workers=4)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model_name, num_labels=len(label_list), id2label=id2label, label2id=label2id)
    no_decay = ["bias", "LayerNorm.weight"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate)

    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    updates_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    total_updates = updates_per_epoch * args.num_train_epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_updates), total_updates)
    scheduler = accelerator.prepare(scheduler)
    accelerator.init_trackers("lmv3_forms", config=vars(args))

    best_f1, global_step = 0.0, 0
    progress = tqdm(range(total_updates), disable=not accelerator.is_local_main_process)
    for epoch in range(args.num_train_epochs):
        model.train()
        for batch in train_loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                progress.update(1)
                global_step += 1
                if global_step % 50 == 0:
                    accelerator.log({"train/loss": loss.item()}, step=global_step)

        f1, report = evaluate(model, eval_loader, accelerator, id2label)
        accelerator.log({"eval/f1": f1, "epoch": epoch}, step=global_step)
        accelerator.print(f"epoch {epoch}: eval f1 = {f1:.4f}\n{report}")
        if accelerator.is_main_process and f1 > best_f1:
            best_f1 = f1
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.save_pretrained(os.path.join(args.output_dir, "best"), save_function=accelerator.save)
            processor.save_pretrained(os.path.join(args.output_dir, "best"))
            with open(os.path.join(args.output_dir, "best", "metrics.json"), "w") as f:
                json.dump({"epoch": epoch, "f1": f1}, f)

    accelerator.wait_for_everyone()
    accelerator.save_state(os.path.join(args.output_dir, "final_state"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
