"""LayoutLMv3 token classification on FUNSD-style forms (question / answer / header).

Baseline for the forms-KIE service. Uses the pre-OCR'd words and boxes that ship with the
dataset, so the processor runs with apply_ocr=False.

    torchrun --standalone --nproc_per_node=4 02_layoutlmv3_funsd_ner.py --output_dir runs/funsd_v3
"""
import argparse
import json
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from seqeval.metrics import classification_report, f1_score, precision_score, recall_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from transformers import AutoProcessor, LayoutLMv3ForTokenClassification, get_cosine_schedule_with_warmup

log = logging.getLogger(__name__)


def get_args():
    parser = argparse.ArgumentParser(description="FUNSD LayoutLMv3 fine-tuning")
    parser.add_argument("--model_name_or_path", default="microsoft/layoutlmv3-base")
    parser.add_argument("--dataset_name", default="nielsr/funsd-layoutlmv3")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--per_device_batch_size", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=1e-5)
    parser.add_argument("--num_epochs", type=int, default=30)
    parser.add_argument("--warmup_steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--fp16", action="store_true")
    return parser.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def encode_split(ds, processor, max_length):
    def _encode(examples):
        images = [img.convert("RGB") for img in examples["image"]]
        enc = processor(
            images,
            examples["tokens"],
            boxes=examples["bboxes"],
            word_labels=examples["ner_tags"],
            truncation=True,
            padding="max_length",
            max_length=max_length,
        )
        return enc

    enc = ds.map(_encode, batched=True, remove_columns=ds.column_names)
    enc.set_format("torch", columns=["input_ids", "attention_mask", "bbox", "pixel_values", "labels"])
    return enc


@torch.no_grad()
def run_eval(model, loader, id2label, device):
    model.eval()
    y_true, y_pred = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        preds = logits.argmax(-1).cpu().numpy()
        labels = batch["labels"].cpu().numpy()
        for p_row, l_row in zip(preds, labels):
            keep = l_row != -100
            y_true.append([id2label[int(l)] for l in l_row[keep]])
            y_pred.append([id2label[int(p)] for p in p_row[keep]])
    model.train()
    return {
        "precision": precision_score(y_true, y_pred),
        "recall": recall_score(y_true, y_pred),
        "f1": f1_score(y_true, y_pred),
        "report": classification_report(y_true, y_pred, digits=4),
    }


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    is_main = rank == 0

    logging.basicConfig(level=logging.INFO if is_main else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    seed_everything(args.seed)

    raw = load_dataset(args.dataset_name)
    label_list = raw["train"].features["ner_tags"].feature.names
    id2label = dict(enumerate(label_list))
    label2id = {v: k for k, v in id2label.items()}

    processor = AutoProcessor.from_pretrained(args.model_name_or_path, apply_ocr=False)

    # encode once on rank 0 so the datasets cache is written by one process
    if is_main:
        train_ds = encode_split(raw["train"], processor, args.max_length)
        test_ds = encode_split(raw["test"], processor, args.max_length)
    dist.barrier()
    if not is_main:
        train_ds = encode_split(raw["train"], processor, args.max_length)
        test_ds = encode_split(raw["test"], processor, args.max_length)

    train_loader = DataLoader(
        train_ds,
        batch_size=args.per_device_batch_size,
        shuffle=True,
        num_workers=4,
        pin_memory=True,
        drop_last=True,
    )
    test_loader = DataLoader(test_ds, batch_size=8, num_workers=2)

    model = LayoutLMv3ForTokenClassification.from_pretrained(
        args.model_name_or_path, num_labels=len(label_list), id2label=id2label, label2id=label2id
    ).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
    num_training_steps = args.num_epochs * len(train_loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, num_training_steps)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

    os.makedirs(args.output_dir, exist_ok=True)
    best_f1 = -1.0
    global_step = 0
    for epoch in range(args.num_epochs):
        model.train()
        epoch_loss = 0.0
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                outputs = model(**batch)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(outputs.loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            epoch_loss += outputs.loss.item()
            global_step += 1
            if is_main and global_step % 50 == 0:
                log.info("step %d lr %.2e loss %.4f", global_step, scheduler.get_last_lr()[0], outputs.loss.item())

        # evaluation on the full test split, rank 0 only (FUNSD test is 50 pages)
        if is_main:
            metrics = run_eval(model.module, test_loader, id2label, device)
            log.info("epoch %d mean_loss %.4f f1 %.4f p %.4f r %.4f", epoch,
                     epoch_loss / len(train_loader), metrics["f1"], metrics["precision"], metrics["recall"])
            if metrics["f1"] > best_f1:
                best_f1 = metrics["f1"]
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                processor.save_pretrained(os.path.join(args.output_dir, "best"))
                with open(os.path.join(args.output_dir, "best_report.txt"), "w") as fh:
                    fh.write(metrics["report"])
        dist.barrier()

    if is_main:
        with open(os.path.join(args.output_dir, "summary.json"), "w") as fh:
            json.dump({"best_f1": best_f1, "epochs": args.num_epochs, "world_size": world_size}, fh, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
