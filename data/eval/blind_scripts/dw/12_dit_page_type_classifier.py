"""Image-only page-type classifier (DiT-base) used as the router in front of the
extraction models: cover page / form / table page / free text / signature page / blank.

Data layout: <root>/<split>/<class_name>/*.png  (torchvision ImageFolder)

    torchrun --nproc_per_node=4 12_dit_page_type_classifier.py --root /mnt/pages/router_v2 --out runs/dit_router
"""
import argparse
import json
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from transformers import AutoImageProcessor, AutoModelForImageClassification, get_cosine_schedule_with_warmup

logger = logging.getLogger("dit_router")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--base", default="microsoft/dit-base-finetuned-rvlcdip")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--layer-decay", type=float, default=0.75)
    ap.add_argument("--warmup-epochs", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--local_rank", type=int, default=0)
    return ap.parse_args()


def build_transforms(image_processor, train):
    size = image_processor.size["height"]
    norm = transforms.Normalize(image_processor.image_mean, image_processor.image_std)
    if train:
        return transforms.Compose([
            transforms.Grayscale(num_output_channels=3),
            transforms.RandomResizedCrop(size, scale=(0.85, 1.0), ratio=(0.7, 1.4)),
            transforms.RandomApply([transforms.GaussianBlur(3)], p=0.2),
            transforms.RandomRotation(3, fill=255),
            transforms.ToTensor(),
            norm,
        ])
    return transforms.Compose([
        transforms.Grayscale(num_output_channels=3),
        transforms.Resize((size, size)),
        transforms.ToTensor(),
        norm,
    ])


def layerwise_param_groups(model, lr, decay, weight_decay=0.05):
    """BEiT-style layer-wise lr decay: embeddings get the smallest lr, the head the largest."""
    n_layers = model.config.num_hidden_layers
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if "embeddings" in name:
            layer_id = 0
        elif ".layer." in name:
            layer_id = int(name.split(".layer.")[1].split(".")[0]) + 1
        else:
            layer_id = n_layers + 1
        no_wd = p.ndim == 1 or name.endswith(".bias")
        key = (layer_id, no_wd)
        if key not in groups:
            groups[key] = {"params": [], "lr": lr * decay ** (n_layers + 1 - layer_id),
                           "weight_decay": 0.0 if no_wd else weight_decay}
        groups[key]["params"].append(p)
    return list(groups.values())


@torch.no_grad()
def evaluate(model, loader, device, n_classes):
    model.eval()
    confusion = torch.zeros(n_classes, n_classes, dtype=torch.long, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(pixel_values=x).logits.argmax(-1)
        confusion.index_put_((y, pred), torch.ones_like(y), accumulate=True)
    dist.all_reduce(confusion)
    model.train()
    return confusion


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    image_processor = AutoImageProcessor.from_pretrained(args.base)
    train_set = datasets.ImageFolder(os.path.join(args.root, "train"), build_transforms(image_processor, True))
    val_set = datasets.ImageFolder(os.path.join(args.root, "val"), build_transforms(image_processor, False))
    classes = train_set.classes  # sorted folder names, identical on every rank
    assert val_set.classes == classes

    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=64,
                        num_workers=args.workers, pin_memory=True)

    model = AutoModelForImageClassification.from_pretrained(
        args.base, num_labels=len(classes), ignore_mismatched_sizes=True,
        id2label=dict(enumerate(classes)), label2id={c: i for i, c in enumerate(classes)},
    ).to(device)
    model = DDP(model, device_ids=[args.local_rank])

    optimizer = torch.optim.AdamW(layerwise_param_groups(model.module, args.lr, args.layer_decay),
                                  lr=args.lr, betas=(0.9, 0.999))
    total = args.epochs * len(train_dl)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_epochs * len(train_dl)), total)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        logger.info("classes=%s train=%d val=%d world=%d", classes, len(train_set), len(val_set), world)

    best_acc = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(pixel_values=x).logits
            loss = criterion(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and i % 100 == 0:
                logger.info("epoch %d it %d/%d loss %.4f", epoch, i, len(train_dl), loss.item())

        conf = evaluate(model.module, val_dl, device, len(classes))
        acc = (conf.diag().sum() / conf.sum()).item()
        if rank == 0:
            per_class = {c: (conf[k, k] / conf[k].sum().clamp(min=1)).item() for k, c in enumerate(classes)}
            logger.info("epoch %d val acc %.4f (%.0fs) per-class %s", epoch, acc, time.time() - t0,
                        json.dumps({k: round(v, 3) for k, v in per_class.items()}))
            if acc > best_acc:
                best_acc = acc
                model.module.save_pretrained(os.path.join(args.out, "best"))
                image_processor.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
