"""
ViT-B/16 fine-tuning on Food-101 with Accelerate + timm, early stopping and W&B logging.

    accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 \
        07_vit_food_accelerate.py --epochs 15 --batch_size 64
"""
import argparse
import math
import os

import timm
import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import set_seed
from timm.data import create_transform, resolve_data_config
from torch.utils.data import DataLoader
from torchvision.datasets import Food101
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_root", default="./data")
    parser.add_argument("--model", default="vit_base_patch16_224.augreg_in21k")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch_size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--weight_decay", type=float, default=0.05)
    parser.add_argument("--warmup_epochs", type=float, default=1.0)
    parser.add_argument("--patience", type=int, default=3)
    parser.add_argument("--output_dir", default="runs/vit_food101")
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--no_wandb", action="store_true")
    return parser.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator(log_with=None if args.no_wandb else "wandb")
    set_seed(args.seed)

    # init_trackers only creates the wandb run on the main process
    accelerator.init_trackers("vit-food101", config=vars(args))

    model = timm.create_model(args.model, pretrained=True, num_classes=101, drop_path_rate=0.1)
    data_cfg = resolve_data_config({}, model=model)
    train_tf = create_transform(**data_cfg, is_training=True, auto_augment="rand-m9-mstd0.5")
    eval_tf = create_transform(**data_cfg, is_training=False)

    with accelerator.main_process_first():
        train_ds = Food101(args.data_root, split="train", transform=train_tf, download=True)
        val_ds = Food101(args.data_root, split="test", transform=eval_tf, download=True)

    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=128, shuffle=False, num_workers=8, pin_memory=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    # Sized on the un-sharded loader: the prepared scheduler advances num_processes
    # times per optimizer step, so this works out to the real number of updates.
    total_sched_steps = len(train_dl) * args.epochs
    warmup_sched_steps = int(len(train_dl) * args.warmup_epochs)
    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup_sched_steps, total_sched_steps)

    model, optimizer, train_dl, val_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, val_dl, scheduler
    )
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    accelerator.print(f"{accelerator.num_processes} processes, {len(train_dl)} steps/epoch per process")

    best_acc, epochs_no_improve = 0.0, 0
    for epoch in range(args.epochs):
        model.train()
        running = 0.0
        bar = tqdm(train_dl, disable=not accelerator.is_local_main_process, desc=f"train {epoch}")
        for step, (images, targets) in enumerate(bar):
            logits = model(images)
            loss = criterion(logits, targets)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

            running += loss.item()
            if step % 50 == 0:
                bar.set_postfix(loss=f"{loss.item():.3f}")
                accelerator.log({"train/loss": loss.item(), "lr": scheduler.get_last_lr()[0]},
                                step=epoch * len(train_dl) + step)

        model.eval()
        correct, seen, val_loss = 0, 0, 0.0
        for images, targets in tqdm(val_dl, disable=not accelerator.is_local_main_process, desc="eval"):
            with torch.no_grad():
                logits = model(images)
            # gather_for_metrics drops the samples the sampler repeated to even out the shards
            logits, targets = accelerator.gather_for_metrics((logits, targets))
            val_loss += nn.functional.cross_entropy(logits, targets, reduction="sum").item()
            correct += (logits.argmax(-1) == targets).sum().item()
            seen += targets.numel()
        val_acc = correct / seen
        val_loss /= seen
        train_loss = accelerator.gather(torch.tensor(running / len(train_dl), device=accelerator.device)).mean().item()

        accelerator.print(f"epoch {epoch}: train_loss {train_loss:.4f} val_loss {val_loss:.4f} val_acc {val_acc:.4f}")
        accelerator.log({"val/loss": val_loss, "val/acc": val_acc, "train/epoch_loss": train_loss, "epoch": epoch},
                        step=(epoch + 1) * len(train_dl))

        # val_acc is computed from gathered predictions, so it is the same number on every process
        if val_acc > best_acc:
            best_acc, epochs_no_improve = val_acc, 0
            accelerator.wait_for_everyone()
            accelerator.save_model(model, os.path.join(args.output_dir, "best"))
            accelerator.print(f"  saved best (acc {best_acc:.4f})")
        else:
            epochs_no_improve += 1
            if epochs_no_improve >= args.patience:
                accelerator.print(f"early stopping at epoch {epoch}")
                break

    accelerator.wait_for_everyone()
    accelerator.save_state(os.path.join(args.output_dir, "last_state"))
    accelerator.print(f"best val acc {best_acc:.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
