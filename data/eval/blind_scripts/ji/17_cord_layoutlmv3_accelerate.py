"""CORD receipt KIE with LayoutLMv3 + HF Accelerate (multi-GPU via `accelerate launch`).

Receipts have very different numbers of OCR words, so batches are padded to the longest
receipt in the batch; predictions are padded across processes before they are gathered.

    accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 \
        17_cord_layoutlmv3_accelerate.py --output_dir runs/cord_v3_acc
"""
import argparse
import math
import os

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import load_dataset
from seqeval.metrics import classification_report, f1_score
from torch.utils.data import DataLoader
from transformers import AutoProcessor, LayoutLMv3ForTokenClassification, get_scheduler

logger = get_logger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="microsoft/layoutlmv3-base")
    p.add_argument("--dataset", default="nielsr/cord-layoutlmv3")
    p.add_argument("--output_dir", default="runs/cord_v3")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--per_device_batch_size", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--warmup_steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--checkpointing_epochs", type=int, default=5)
    p.add_argument("--resume_from", default=None)
    return p.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, log_with="tensorboard",
                              project_dir=args.output_dir)
    set_seed(args.seed)
    logger.info(accelerator.state, main_process_only=False)

    processor = AutoProcessor.from_pretrained(args.model, apply_ocr=False)
    raw = load_dataset(args.dataset)
    label_list = raw["train"].features["ner_tags"].feature.names
    id2label = dict(enumerate(label_list))

    def prepare(batch):
        enc = processor([im.convert("RGB") for im in batch["image"]], batch["words"], boxes=batch["bboxes"],
                        word_labels=batch["ner_tags"], truncation=True, max_length=512)
        return enc

    with accelerator.main_process_first():
        cols = raw["train"].column_names
        train_ds = raw["train"].map(prepare, batched=True, remove_columns=cols)
        eval_ds = raw["test"].map(prepare, batched=True, remove_columns=cols)

    tok = processor.tokenizer

    def collate(features):
        pixel_values = torch.stack([torch.tensor(f["pixel_values"]) for f in features])
        max_len = max(len(f["input_ids"]) for f in features)
        def pad(key, value):
            return torch.tensor([f[key] + [value] * (max_len - len(f[key])) for f in features])
        return {
            "input_ids": pad("input_ids", tok.pad_token_id),
            "attention_mask": pad("attention_mask", 0),
            "bbox": torch.tensor([f["bbox"] + [[0, 0, 0, 0]] * (max_len - len(f["bbox"])) for f in features]),
            "labels": pad("labels", -100),
            "pixel_values": pixel_values,
        }

    train_dl = DataLoader(train_ds, shuffle=True, batch_size=args.per_device_batch_size, collate_fn=collate,
                          num_workers=4)
    eval_dl = DataLoader(eval_ds, shuffle=False, batch_size=args.per_device_batch_size, collate_fn=collate,
                         num_workers=4)

    model = LayoutLMv3ForTokenClassification.from_pretrained(
        args.model, num_labels=len(label_list), id2label=id2label, label2id={v: k for k, v in id2label.items()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    # prepare() shards the loaders (one slice per process), so the step count must be taken afterwards
    model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
    updates_per_epoch = math.ceil(len(train_dl) / args.grad_accum)
    max_steps = args.epochs * updates_per_epoch
    # the prepared scheduler is stepped once per process on every optimizer step
    scheduler = get_scheduler("linear", optimizer,
                              num_warmup_steps=args.warmup_steps * accelerator.num_processes,
                              num_training_steps=max_steps * accelerator.num_processes)
    scheduler = accelerator.prepare(scheduler)
    accelerator.init_trackers("cord_layoutlmv3", config=vars(args))

    start_epoch = 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        start_epoch = int(os.path.basename(args.resume_from.rstrip("/")).split("_")[-1]) + 1

    best_f1 = 0.0
    for epoch in range(start_epoch, args.epochs):
        model.train()
        total = 0.0
        for batch in train_dl:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            total += loss.detach().float()

        model.eval()
        y_true, y_pred = [], []
        for batch in eval_dl:
            with torch.no_grad():
                logits = model(**batch).logits
            preds = logits.argmax(-1)
            labels = batch["labels"]
            # batch lengths differ per process: pad to a common length before gathering
            preds = accelerator.pad_across_processes(preds, dim=1, pad_index=-100)
            labels = accelerator.pad_across_processes(labels, dim=1, pad_index=-100)
            preds, labels = accelerator.gather_for_metrics((preds, labels))
            for p_row, l_row in zip(preds.cpu().tolist(), labels.cpu().tolist()):
                y_true.append([label_list[l] for l in l_row if l != -100])
                y_pred.append([label_list[p] for p, l in zip(p_row, l_row) if l != -100])
        f1 = f1_score(y_true, y_pred)
        mean_loss = accelerator.gather(total).mean().item() / len(train_dl)
        accelerator.print(f"epoch {epoch}: train loss {mean_loss:.4f} test F1 {f1:.4f}")
        accelerator.log({"train_loss": mean_loss, "test_f1": f1}, step=epoch)

        if (epoch + 1) % args.checkpointing_epochs == 0:
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))
        if f1 > best_f1:
            best_f1 = f1
            accelerator.wait_for_everyone()
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.save_pretrained(os.path.join(args.output_dir, "best"), is_main_process=accelerator.is_main_process,
                                      save_function=accelerator.save)
            if accelerator.is_main_process:
                processor.save_pretrained(os.path.join(args.output_dir, "best"))
                with open(os.path.join(args.output_dir, "best", "report.txt"), "w") as fh:
                    fh.write(classification_report(y_true, y_pred, digits=4))

    accelerator.print(f"best test F1 {best_f1:.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
