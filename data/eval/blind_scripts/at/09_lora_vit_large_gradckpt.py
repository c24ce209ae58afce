"""
Parameter-efficient fine-tuning of ViT-L/16 (ImageNet-21k) on iNaturalist-2021
mini with LoRA on the attention projections (peft). Activation checkpointing
keeps the 304M-parameter backbone within 24 GB at 384px.

    torchrun --nproc_per_node=4 lora_vit.py --train-dir /data/inat21/train_mini \
        --val-dir /data/inat21/val --image-size 384
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from transformers import ViTForImageClassification, get_cosine_schedule_with_warmup


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="google/vit-large-patch16-224-in21k")
    p.add_argument("--train-dir", required=True)
    p.add_argument("--val-dir", required=True)
    p.add_argument("--image-size", type=int, default=384)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-ratio", type=float, default=0.05)
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--output", default="/shared/runs/vitl_lora_inat")
    return p.parse_args()


def build_loaders(args, world, rank):
    mean, std = [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(args.image_size, scale=(0.3, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), transforms.Normalize(mean, std)])
    val_tf = transforms.Compose([
        transforms.Resize(int(args.image_size * 1.14)), transforms.CenterCrop(args.image_size),
        transforms.ToTensor(), transforms.Normalize(mean, std)])
    train = datasets.ImageFolder(args.train_dir, train_tf)
    val = datasets.ImageFolder(args.val_dir, val_tf)
    assert train.classes == val.classes
    ts = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True)
    vs = DistributedSampler(val, num_replicas=world, rank=rank, shuffle=False)
    tl = DataLoader(train, batch_size=args.batch_size, sampler=ts, num_workers=args.workers,
                    pin_memory=True, drop_last=True, persistent_workers=True)
    vl = DataLoader(val, batch_size=64, sampler=vs, num_workers=args.workers, pin_memory=True)
    return tl, vl, ts, len(train.classes)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    for pixel_values, labels in loader:
        pixel_values = pixel_values.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(pixel_values=pixel_values, interpolate_pos_encoding=True).logits
        stats[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        stats[1] += (logits.argmax(-1) == labels).sum()
        stats[2] += labels.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (100 * stats[1] / stats[2]).item()


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    train_loader, val_loader, train_sampler, num_classes = build_loaders(args, world, rank)

    model = ViTForImageClassification.from_pretrained(args.model, num_labels=num_classes,
                                                      ignore_mismatched_sizes=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    lora_cfg = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.1,
                          target_modules=["query", "value"], modules_to_save=["classifier"])
    model = get_peft_model(model, lora_cfg)
    if rank == 0:
        model.print_trainable_parameters()
    model.to(device)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for step, (pixel_values, labels) in enumerate(train_loader):
            pixel_values = pixel_values.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(pixel_values=pixel_values, interpolate_pos_encoding=True).logits
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} {(time.time() - tic) / (step + 1):.2f}s/it",
                      flush=True)

        val_loss, val_acc = validate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f} val_acc {val_acc:.2f}", flush=True)
            if val_acc > best_acc:
                best_acc = val_acc
                model.module.save_pretrained(os.path.join(args.output, "best_adapter"))
            model.module.save_pretrained(os.path.join(args.output, "last_adapter"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
