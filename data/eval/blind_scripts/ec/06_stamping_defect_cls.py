"""Surface-defect classifier for the stamping line (EfficientNet-B0, timm).

Classes come from the folder names of the labelled inspection crops
(ok / scratch / dent / crack / oil_stain / burr). Jobs on the shared queue
are pre-empted regularly, so training resumes from --resume automatically.

    torchrun --nproc_per_node=4 06_stamping_defect_cls.py --data /mnt/nas/stamping/crops \
        --output /mnt/nas/stamping/runs/effb0 --resume /mnt/nas/stamping/runs/effb0/last.pth
"""
import argparse
import logging
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import confusion_matrix, f1_score
from timm.data import create_transform
from timm.loss import LabelSmoothingCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder

_logger = logging.getLogger("train")


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--model", default="efficientnet_b0")
    ap.add_argument("--img-size", type=int, default=288)
    ap.add_argument("--batch-size", type=int, default=48, help="per GPU")
    ap.add_argument("--base-lr", type=float, default=5e-4, help="lr for a global batch of 256")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--warmup-epochs", type=int, default=3)
    ap.add_argument("--smoothing", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--amp", action="store_true")
    ap.add_argument("--resume", default="")
    return ap.parse_args()


def build_loaders(args, world, rank):
    train_tf = create_transform(args.img_size, is_training=True, auto_augment="rand-m7-mstd0.5",
                                re_prob=0.2, hflip=0.5, vflip=0.5)
    eval_tf = create_transform(args.img_size, is_training=False, crop_pct=1.0)
    train_ds = ImageFolder(os.path.join(args.data, "train"), transform=train_tf)
    val_ds = ImageFolder(os.path.join(args.data, "val"), transform=eval_tf)
    assert train_ds.classes == val_ds.classes, "train/val class folders differ"
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size * 2, sampler=val_sampler, num_workers=args.workers,
                        pin_memory=True)
    return train_ds, train_dl, train_sampler, val_ds, val_dl


@torch.no_grad()
def validate(model, loader, n_val, device, world):
    model.eval()
    preds, targets, idxs = [], [], []
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(images)
        preds.append(logits.argmax(1))
        targets.append(labels.to(device))
    preds, targets = torch.cat(preds), torch.cat(targets)
    # DistributedSampler(shuffle=False) hands out indices rank, rank+W, ... (padded at the end)
    all_p = [torch.zeros_like(preds) for _ in range(world)]
    all_t = [torch.zeros_like(targets) for _ in range(world)]
    dist.all_gather(all_p, preds)
    dist.all_gather(all_t, targets)
    p = torch.stack(all_p, 1).flatten()[:n_val].cpu().numpy()
    t = torch.stack(all_t, 1).flatten()[:n_val].cpu().numpy()
    model.train()
    return p, t


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)

    train_ds, train_dl, train_sampler, val_ds, val_dl = build_loaders(args, world, rank)
    classes = train_ds.classes
    _logger.info("classes: %s, train %d, val %d", classes, len(train_ds), len(val_ds))

    model = timm.create_model(args.model, pretrained=True, num_classes=len(classes), drop_rate=0.2)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.base_lr * args.batch_size * world / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    steps_per_epoch = len(train_dl)
    warmup = args.warmup_epochs * steps_per_epoch
    total = args.epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total,
                                                    pct_start=warmup / total, anneal_strategy="cos")
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    criterion = LabelSmoothingCrossEntropy(smoothing=args.smoothing)

    start_epoch, best_f1 = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        checkpoint = torch.load(args.resume)
        model.module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        scaler.load_state_dict(checkpoint["scaler"])
        start_epoch = checkpoint["epoch"] + 1
        best_f1 = checkpoint["best_f1"]
        _logger.info("resumed from %s at epoch %d (best macro-F1 %.4f)", args.resume, start_epoch, best_f1)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for images, labels in train_dl:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            loss_sum[0] += loss.detach()
            loss_sum[1] += 1
        dist.all_reduce(loss_sum)

        preds, targets = validate(model, val_dl, len(val_ds), device, world)
        if rank == 0:
            macro_f1 = f1_score(targets, preds, average="macro")
            acc = float((preds == targets).mean())
            _logger.info("epoch %d | loss %.4f | val acc %.4f | macro-F1 %.4f | %.0fs", epoch,
                         (loss_sum[0] / loss_sum[1]).item(), acc, macro_f1, time.time() - t0)
            is_best = macro_f1 > best_f1
            best_f1 = max(best_f1, macro_f1)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch, "best_f1": best_f1, "classes": classes}
            torch.save(state, os.path.join(args.output, "last.pth"))
            if is_best:
                torch.save(state, os.path.join(args.output, "best.pth"))
                np.savetxt(os.path.join(args.output, "best_confusion.txt"),
                           confusion_matrix(targets, preds), fmt="%d")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
