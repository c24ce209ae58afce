"""
Fine-tune google/vit-base-patch16-224-in21k on Oxford-IIIT Pets (37 breeds).
HF transformers model, plain PyTorch DDP training loop (no Trainer).

    torchrun --nproc_per_node=4 16_vit_pets_hf_ddp.py --epochs 10 --batch_size 32
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.transforms import (CenterCrop, Compose, Normalize, RandomHorizontalFlip,
                                    RandomResizedCrop, Resize, ToTensor)
from tqdm import tqdm
from transformers import ViTForImageClassification, ViTImageProcessor, get_linear_schedule_with_warmup


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name", default="google/vit-base-patch16-224-in21k")
    parser.add_argument("--dataset", default="timm/oxford-iiit-pet")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--warmup_ratio", type=float, default=0.1)
    parser.add_argument("--num_workers", type=int, default=6)
    parser.add_argument("--output_dir", default="vit-pets")
    return parser.parse_args()


def build_transforms(processor):
    size = processor.size["height"]
    normalize = Normalize(mean=processor.image_mean, std=processor.image_std)
    train_tf = Compose([RandomResizedCrop(size), RandomHorizontalFlip(), ToTensor(), normalize])
    val_tf = Compose([Resize(size), CenterCrop(size), ToTensor(), normalize])
    return train_tf, val_tf


def collate_fn(examples):
    pixel_values = torch.stack([ex["pixel_values"] for ex in examples])
    labels = torch.tensor([ex["label"] for ex in examples])
    return {"pixel_values": pixel_values, "labels": labels}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    # download on rank 0 first so the HF cache is not written by everyone at once
    if rank == 0:
        ds = load_dataset(args.dataset)
    dist.barrier()
    if rank != 0:
        ds = load_dataset(args.dataset)

    labels = ds["train"].features["label"].names
    id2label = {i: l for i, l in enumerate(labels)}
    label2id = {l: i for i, l in id2label.items()}

    processor = ViTImageProcessor.from_pretrained(args.model_name)
    train_tf, val_tf = build_transforms(processor)

    def train_transform(batch):
        batch["pixel_values"] = [train_tf(img.convert("RGB")) for img in batch["image"]]
        return batch

    def val_transform(batch):
        batch["pixel_values"] = [val_tf(img.convert("RGB")) for img in batch["image"]]
        return batch

    train_ds = ds["train"].with_transform(train_transform)
    val_ds = ds["test"].with_transform(val_transform)

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate_fn, num_workers=args.num_workers, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=64, shuffle=False, collate_fn=collate_fn,
                            num_workers=args.num_workers)

    model = ViTForImageClassification.from_pretrained(
        args.model_name, num_labels=len(labels), id2label=id2label, label2id=label2id
    ).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    num_training_steps = args.epochs * len(train_loader)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=int(args.warmup_ratio * num_training_steps),
        num_training_steps=num_training_steps,
    )

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"{len(labels)} classes, {len(train_ds)} train / {len(val_ds)} test, {world_size} GPUs")

    best_acc = 0.0
    for epoch in range(args.epochs):
        model.train()
        start = time.time()
        loss_total = torch.zeros(1, device=device)
        progress = tqdm(train_loader, desc=f"Epoch {epoch + 1}/{args.epochs}", disable=rank != 0)
        for batch in progress:
            pixel_values = batch["pixel_values"].to(device, non_blocking=True)
            targets = batch["labels"].to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                outputs = model(pixel_values=pixel_values, labels=targets)
            loss = outputs.loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            loss_total += loss.detach()
            progress.set_postfix(loss=f"{loss.item():.4f}")

        dist.all_reduce(loss_total)
        train_loss = loss_total.item() / (len(train_loader) * world_size)

        if rank == 0:
            model.eval()
            correct, count, val_loss = 0, 0, 0.0
            with torch.no_grad():
                for batch in val_loader:
                    pixel_values = batch["pixel_values"].to(device)
                    targets = batch["labels"].to(device)
                    logits = model.module(pixel_values=pixel_values).logits
                    val_loss += F.cross_entropy(logits, targets, reduction="sum").item()
                    correct += (logits.argmax(-1) == targets).sum().item()
                    count += targets.size(0)
            val_acc = correct / count
            print(f"epoch {epoch + 1}: train loss {train_loss:.4f} | val loss {val_loss / count:.4f} "
                  f"| val acc {val_acc:.4f} | {time.time() - start:.0f}s")
            if val_acc > best_acc:
                best_acc = val_acc
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                processor.save_pretrained(os.path.join(args.output_dir, "best"))
                print(f"  best so far, saved to {args.output_dir}/best")
        dist.barrier()

    if rank == 0:
        print(f"best val accuracy {best_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
