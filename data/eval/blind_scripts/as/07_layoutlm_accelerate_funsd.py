"""
Fine-tune LayoutLMv3 for token classification (FUNSD / CORD style entity labelling)
with Hugging Face Accelerate.

    accelerate launch --multi_gpu --num_processes 4 --mixed_precision fp16 \
        finetune_layoutlmv3.py --dataset nielsr/funsd-layoutlmv3 --output_dir out/funsd_v3
"""
import argparse
import json
import math
import os

import evaluate
import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import (
    AutoModelForTokenClassification,
    AutoProcessor,
    default_data_collator,
    get_linear_schedule_with_warmup,
)

logger = get_logger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="nielsr/funsd-layoutlmv3")
    p.add_argument("--model_name", default="microsoft/layoutlmv3-base")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--per_device_batch_size", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--warmup_ratio", type=float, default=0.1)
    p.add_argument("--max_length", type=int, default=512)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--with_tracking", action="store_true")
    return p.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.grad_accum,
        log_with="tensorboard" if args.with_tracking else None,
        project_dir=args.output_dir,
    )
    set_seed(args.seed)

    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    raw = load_dataset(args.dataset)
    features = raw["train"].features
    label_list = features["ner_tags"].feature.names
    id2label = dict(enumerate(label_list))
    label2id = {v: k for k, v in id2label.items()}

    processor = AutoProcessor.from_pretrained(args.model_name, apply_ocr=False)

    def prepare(examples):
        enc = processor(
            examples["image"],
            examples["tokens"],
            boxes=examples["bboxes"],
            word_labels=examples["ner_tags"],
            truncation=True,
            padding="max_length",
            max_length=args.max_length,
        )
        return enc

    # tokenise once on the main process, the others read the datasets cache
    with accelerator.main_process_first():
        train_ds = raw["train"].map(prepare, batched=True, remove_columns=raw["train"].column_names,
                                    desc="encoding train")
        eval_ds = raw["test"].map(prepare, batched=True, remove_columns=raw["test"].column_names,
                                  desc="encoding test")
    train_ds.set_format("torch")
    eval_ds.set_format("torch")

    train_loader = DataLoader(train_ds, shuffle=True, batch_size=args.per_device_batch_size,
                              collate_fn=default_data_collator, num_workers=4)
    eval_loader = DataLoader(eval_ds, batch_size=args.per_device_batch_size,
                             collate_fn=default_data_collator, num_workers=4)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model_name, num_labels=len(label_list), id2label=id2label, label2id=label2id)

    no_decay = ["bias", "LayerNorm.weight"]
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.lr)

    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, train_loader, eval_loader)

    # computed after prepare(): the loader is now sharded across processes
    steps_per_epoch = math.ceil(len(train_loader) / args.grad_accum)
    max_steps = args.epochs * steps_per_epoch
    scheduler = get_linear_schedule_with_warmup(
        optimizer, int(args.warmup_ratio * max_steps), max_steps)
    scheduler = accelerator.prepare(scheduler)

    if args.with_tracking:
        accelerator.init_trackers("layoutlmv3_funsd", config=vars(args))

    seqeval = evaluate.load("seqeval")
    best_f1 = -1.0
    progress = tqdm(range(max_steps), disable=not accelerator.is_local_main_process)
    completed = 0

    for epoch in range(args.epochs):
        model.train()
        total_loss = 0.0
        for batch in train_loader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                total_loss += loss.detach().float()
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                progress.update(1)
                completed += 1

        model.eval()
        for batch in eval_loader:
            with torch.no_grad():
                logits = model(**batch).logits
            preds = logits.argmax(-1)
            labels = batch["labels"]
            preds, labels = accelerator.gather_for_metrics((preds, labels))
            preds, labels = preds.cpu().numpy(), labels.cpu().numpy()
            true_preds = [[id2label[p] for p, l in zip(pr, lb) if l != -100] for pr, lb in zip(preds, labels)]
            true_labels = [[id2label[l] for p, l in zip(pr, lb) if l != -100] for pr, lb in zip(preds, labels)]
            seqeval.add_batch(predictions=true_preds, references=true_labels)
        results = seqeval.compute()
        mean_loss = accelerator.reduce(total_loss, reduction="mean").item() / max(len(train_loader), 1)
        logger.info(f"epoch {epoch}: loss {mean_loss:.4f} P {results['overall_precision']:.4f} "
                    f"R {results['overall_recall']:.4f} F1 {results['overall_f1']:.4f}",
                    main_process_only=True)
        if args.with_tracking:
            accelerator.log({"train_loss": mean_loss, "eval_f1": results["overall_f1"],
                             "eval_precision": results["overall_precision"],
                             "eval_recall": results["overall_recall"]}, step=completed)

        if results["overall_f1"] > best_f1:
            best_f1 = results["overall_f1"]
            accelerator.wait_for_everyone()
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.save_pretrained(os.path.join(args.output_dir, "best"),
                                      is_main_process=accelerator.is_main_process,
                                      save_function=accelerator.save)
            if accelerator.is_main_process:
                processor.save_pretrained(os.path.join(args.output_dir, "best"))
                with open(os.path.join(args.output_dir, "best", "eval_results.json"), "w") as f:
                    json.dump({k: float(v) if isinstance(v, (float, np.floating)) else v
                               for k, v in results.items() if k.startswith("overall")}, f, indent=2)

    accelerator.save_state(os.path.join(args.output_dir, "last_state"))
    if args.with_tracking:
        accelerator.end_training()
    logger.info(f"best F1 {best_f1:.4f}", main_process_only=True)


if __name__ == "__main__":
    main()
