"""Fine-tune google/vit-base-patch16-224-in21k on Food-101 (HF datasets), tracked in W&B.

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 11_food_vit_wandb.py \
        --wandb_project food101 --run_name vitb16-bs256
"""
import argparse
import math
import os

import numpy as np
import torch
import wandb
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from torchvision.transforms import (
    CenterCrop,
    Compose,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    ToTensor,
)
from transformers import AutoImageProcessor, AutoModelForImageClassification, get_cosine_schedule_with_warmup


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_name", default="google/vit-base-patch16-224-in21k")
    ap.add_argument("--dataset", default="food101")
    ap.add_argument("--output_dir", default="runs/food_vit")
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--weight_decay", type=float, default=0.05)
    ap.add_argument("--warmup_steps", type=int, default=1000)
    ap.add_argument("--label_smoothing", type=float, default=0.1)
    ap.add_argument("--wandb_project", default="food101")
    ap.add_argument("--run_name", default=None)
    ap.add_argument("--log_interval", type=int, default=25)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator()
    set_seed(args.seed)

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    processor = AutoImageProcessor.from_pretrained(args.model_name)
    size = processor.size["height"]
    normalize = Normalize(mean=processor.image_mean, std=processor.image_std)
    train_tf = Compose([RandomResizedCrop(size), RandomHorizontalFlip(), ToTensor(), normalize])
    eval_tf = Compose([Resize(int(size / 0.875)), CenterCrop(size), ToTensor(), normalize])

    with accelerator.main_process_first():
        ds = load_dataset(args.dataset)
    labels = ds["train"].features["label"].names
    id2label = {i: l for i, l in enumerate(labels)}
    label2id = {l: i for i, l in id2label.items()}

    def apply_train(batch):
        batch["pixel_values"] = [train_tf(img.convert("RGB")) for img in batch["image"]]
        return batch

    def apply_eval(batch):
        batch["pixel_values"] = [eval_tf(img.convert("RGB")) for img in batch["image"]]
        return batch

    train_ds = ds["train"].with_transform(apply_train)
    eval_ds = ds["validation"].with_transform(apply_eval)

    def collate(examples):
        return {
            "pixel_values": torch.stack([e["pixel_values"] for e in examples]),
            "labels": torch.tensor([e["label"] for e in examples]),
        }

    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, collate_fn=collate,
                              num_workers=8, pin_memory=True, drop_last=True)
    eval_loader = DataLoader(eval_ds, batch_size=args.batch_size * 2, collate_fn=collate, num_workers=8)

    model = AutoModelForImageClassification.from_pretrained(
        args.model_name, num_labels=len(labels), id2label=id2label, label2id=label2id
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    num_training_steps = args.epochs * len(train_loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps * accelerator.num_processes,
                                                num_training_steps)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )

    global_step = 0
    best_top1 = 0.0
    for epoch in range(args.epochs):
        model.train()
        for batch in train_loader:
            logits = model(pixel_values=batch["pixel_values"]).logits
            loss = criterion(logits, batch["labels"])
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            global_step += 1
            if global_step % args.log_interval == 0:
                loss_avg = accelerator.gather(loss.detach()).mean().item()
                if accelerator.is_main_process:
                    wandb.log({"train/loss": loss_avg, "train/lr": scheduler.get_last_lr()[0],
                               "epoch": epoch}, step=global_step)

        model.eval()
        top1 = top5 = seen = 0
        for batch in eval_loader:
            with torch.no_grad():
                logits = model(pixel_values=batch["pixel_values"]).logits
            logits, refs = accelerator.gather_for_metrics((logits, batch["labels"]))
            top5_idx = logits.topk(5, dim=-1).indices
            top1 += (top5_idx[:, 0] == refs).sum().item()
            top5 += (top5_idx == refs.unsqueeze(1)).any(dim=1).sum().item()
            seen += refs.numel()
        top1, top5 = top1 / seen, top5 / seen
        accelerator.print(f"epoch {epoch}: top1 {top1:.4f} top5 {top5:.4f}")
        if accelerator.is_main_process:
            wandb.log({"eval/top1": top1, "eval/top5": top5, "epoch": epoch}, step=global_step)

        accelerator.wait_for_everyone()
        if top1 > best_top1:
            best_top1 = top1
            accelerator.unwrap_model(model).save_pretrained(
                os.path.join(args.output_dir, "best"),
                is_main_process=accelerator.is_main_process,
                save_function=accelerator.save,
            )
            if accelerator.is_main_process:
                processor.save_pretrained(os.path.join(args.output_dir, "best"))
                wandb.run.summary["best_top1"] = best_top1

    wandb.finish()
    accelerator.end_training()


if __name__ == "__main__":
    main()
