"""Fine-tune EfficientNet-B3 (ImageNet weights) on an in-house product image set.

The data comes as one ImageFolder tree (one folder per SKU class); we hold out
10% for validation.

    torchrun --nproc_per_node=4 05_effnet_products.py --data /data/products_v3
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, random_split
from torchvision import datasets

import timm
from timm.data import Mixup, create_transform, resolve_data_config
from timm.loss import SoftTargetCrossEntropy
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV2

DEFAULTS = dict(
    model="efficientnet_b3",
    img_size=300,
    batch_size=48,
    epochs=40,
    warmup_epochs=2,
    lr=1e-3,
    weight_decay=1e-5,
    smoothing=0.1,
    cutmix=1.0,
    mixup=0.2,
    ema_decay=0.9995,
    val_frac=0.1,
    workers=8,
    seed=17,
)


def get_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--config", default=None, help="optional yaml overriding DEFAULTS")
    ap.add_argument("--out", default="/shared/exp/effnet_b3_products")
    ap.add_argument("--resume", default=None)
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f))
    cfg.update(data=a.data, out=a.out, resume=a.resume)
    return argparse.Namespace(**cfg)


class TransformSubset(torch.utils.data.Dataset):
    """Subset of an ImageFolder with its own transform (train and val need different ones)."""

    def __init__(self, base, indices, transform):
        self.base, self.indices, self.transform = base, list(indices), transform

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        path, target = self.base.samples[self.indices[i]]
        img = self.base.loader(path)
        return self.transform(img), target


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    seen = torch.zeros(1, device=device)
    loss_sum = torch.zeros(1, device=device)
    ce = nn.CrossEntropyLoss(reduction="sum")
    for x, y in loader:
        x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x)
        loss_sum += ce(logits.float(), y)
        correct += (logits.argmax(-1) == y).sum()
        seen += y.numel()
    for t in (correct, seen, loss_sum):
        dist.all_reduce(t)
    return (correct / seen).item() * 100, (loss_sum / seen).item()


def main():
    cfg = get_cfg()
    rank, world, local_rank = setup()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed + rank)

    base = datasets.ImageFolder(cfg.data)
    num_classes = len(base.classes)
    n_val = int(len(base) * cfg.val_frac)
    train_idx, val_idx = random_split(range(len(base)), [len(base) - n_val, n_val])

    model = timm.create_model(cfg.model, pretrained=True, num_classes=num_classes, drop_rate=0.3,
                              drop_path_rate=0.2)
    dcfg = resolve_data_config({}, model=model)
    train_tf = create_transform(cfg.img_size, is_training=True, auto_augment="rand-m9-mstd0.5",
                                interpolation="bicubic", mean=dcfg["mean"], std=dcfg["std"], re_prob=0.2)
    val_tf = create_transform(cfg.img_size, is_training=False, crop_pct=0.904, interpolation="bicubic",
                              mean=dcfg["mean"], std=dcfg["std"])
    train_ds = TransformSubset(base, train_idx, train_tf)
    val_ds = TransformSubset(base, val_idx, val_tf)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler,
                              num_workers=cfg.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=96,
                            num_workers=cfg.workers, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device, memory_format=torch.channels_last)
    ddp = DDP(model, device_ids=[local_rank])
    ema = ModelEmaV2(model, decay=cfg.ema_decay)

    # lr in the config is for a global batch of 256
    lr = cfg.lr * cfg.batch_size * world / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
    scheduler = CosineLRScheduler(optimizer, t_initial=cfg.epochs, warmup_t=cfg.warmup_epochs,
                                  warmup_lr_init=lr * 0.01, lr_min=lr * 0.01)
    scaler = torch.cuda.amp.GradScaler()
    mixup = Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, label_smoothing=cfg.smoothing,
                  num_classes=num_classes)
    criterion = SoftTargetCrossEntropy()

    start_epoch, best = 0, 0.0
    if cfg.resume:
        ck = torch.load(cfg.resume, map_location="cpu")
        model.load_state_dict(ck["model"])
        ema.module.load_state_dict(ck["ema"])
        optimizer.load_state_dict(ck["optimizer"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        print(f"{num_classes} classes, {len(train_ds)} train / {len(val_ds)} val, world {world}, lr {lr:.2e}")

    for epoch in range(start_epoch, cfg.epochs):
        train_sampler.set_epoch(epoch)
        scheduler.step(epoch)
        ddp.train()
        t0, running = time.time(), 0.0
        for i, (x, y) in enumerate(train_loader):
            x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            x, y_soft = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(ddp(x), y_soft)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            scaler.step(optimizer)
            scaler.update()
            ema.update(model)
            running += loss.item()
            if rank == 0 and (i + 1) % 50 == 0:
                print(f"[{epoch}][{i + 1}/{len(train_loader)}] loss {running / 50:.4f}")
                running = 0.0

        acc, vloss = evaluate(model, val_loader, device)
        ema_acc, _ = evaluate(ema.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val acc {acc:.2f} loss {vloss:.4f} ema acc {ema_acc:.2f} "
                  f"({time.time() - t0:.0f}s)")
            ck = {"model": model.state_dict(), "ema": ema.module.state_dict(),
                  "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                  "epoch": epoch, "best": max(best, ema_acc), "classes": base.classes}
            torch.save(ck, os.path.join(cfg.out, "last.pt"))
            if ema_acc > best:
                torch.save(ck, os.path.join(cfg.out, "best.pt"))
        best = max(best, ema_acc)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
