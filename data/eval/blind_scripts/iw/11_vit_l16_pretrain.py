#!/usr/bin/env python3
"""Supervised ViT-L/16 pre-training on ImageNet-21k-P (winter21, 10450 classes).

Recipe after "ImageNet-21K Pretraining for the Masses": 80 epochs, AdamW, one-cycle
(cosine) schedule, label smoothing, RandAugment + cutout, EMA. Multi-node via torchrun.
"""
import argparse
import dataclasses
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision import datasets

import timm
from timm.data import create_transform
from timm.loss import LabelSmoothingCrossEntropy
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV2


@dataclasses.dataclass
class Config:
    data: str = "/fsx/imagenet21k_resized"
    model: str = "vit_large_patch16_224"
    num_classes: int = 10450
    batch_size: int = 64             # per GPU
    epochs: int = 80
    blr: float = 1.5e-4              # lr per 256 images
    min_lr: float = 1e-6
    warmup_epochs: int = 5
    weight_decay: float = 0.05
    label_smoothing: float = 0.2
    drop_path: float = 0.1
    ema_decay: float = 0.9997
    grad_clip: float = 1.0
    workers: int = 12
    out_dir: str = "/fsx/runs/vit_l16_in21k_p"
    log_every: int = 200


def parse_config():
    ap = argparse.ArgumentParser()
    for f in dataclasses.fields(Config):
        ap.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=type(f.default), default=f.default)
    ap.add_argument("--config", default="", help="optional json file overriding the defaults")
    ns = ap.parse_args()
    cfg = Config(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(Config)})
    if ns.config:
        with open(ns.config) as fh:
            cfg = dataclasses.replace(cfg, **json.load(fh))
    return cfg


def build_loaders(cfg, rank, world):
    t_train = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                               re_prob=0.5, interpolation="bicubic")
    t_val = create_transform(224, is_training=False, interpolation="bicubic", crop_pct=0.875)
    train = datasets.ImageFolder(os.path.join(cfg.data, "imagenet21k_train"), t_train)
    val = datasets.ImageFolder(os.path.join(cfg.data, "imagenet21k_val"), t_val)
    assert len(train.classes) == cfg.num_classes, len(train.classes)
    sampler = torch.utils.data.DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True)
    val_shard = torch.utils.data.Subset(val, range(rank, len(val), world))
    train_loader = torch.utils.data.DataLoader(train, batch_size=cfg.batch_size, sampler=sampler,
                                               num_workers=cfg.workers, pin_memory=True, drop_last=True,
                                               persistent_workers=True)
    val_loader = torch.utils.data.DataLoader(val_shard, batch_size=2 * cfg.batch_size,
                                             num_workers=cfg.workers, pin_memory=True)
    return train_loader, val_loader, sampler


def param_groups(model, wd):
    decay, no_decay = [], []
    skip = set(model.no_weight_decay())
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim <= 1 or name in skip:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    agg = torch.zeros(3, device=device, dtype=torch.float64)
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(images)
        top5 = logits.topk(5, -1).indices
        agg[0] += (top5[:, 0] == labels).sum()
        agg[1] += (top5 == labels.unsqueeze(1)).any(-1).sum()
        agg[2] += labels.numel()
    dist.all_reduce(agg)
    return {"top1": (100 * agg[0] / agg[2]).item(), "top5": (100 * agg[1] / agg[2]).item()}


def main():
    cfg = parse_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0
    torch.manual_seed(0)

    train_loader, val_loader, sampler = build_loaders(cfg, rank, world)

    model = timm.create_model(cfg.model, num_classes=cfg.num_classes, drop_path_rate=cfg.drop_path)
    model.to(device)
    model = DDP(model, device_ids=[local_rank], bucket_cap_mb=100)
    net = model.module
    ema = ModelEmaV2(net, decay=cfg.ema_decay)

    lr = cfg.blr * cfg.batch_size / 256
    optimizer = torch.optim.AdamW(param_groups(net, cfg.weight_decay), lr=lr, betas=(0.9, 0.95))
    n_iter = len(train_loader)
    scheduler = CosineLRScheduler(optimizer, t_initial=cfg.epochs * n_iter, lr_min=cfg.min_lr,
                                  warmup_t=cfg.warmup_epochs * n_iter, warmup_lr_init=1e-7,
                                  t_in_epochs=False)
    criterion = LabelSmoothingCrossEntropy(smoothing=cfg.label_smoothing)

    start_epoch = 0
    ckpt_path = os.path.join(cfg.out_dir, "last.pth")
    if os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(state["model"])
        ema.module.load_state_dict(state["ema"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
    if is_main:
        os.makedirs(cfg.out_dir, exist_ok=True)
        print(f"world size {world}, per-GPU batch {cfg.batch_size}, lr {lr:.3e}, "
              f"{n_iter} iters/epoch, resuming at epoch {start_epoch}", flush=True)

    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (images, labels) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            scheduler.step_update(epoch * n_iter + it + 1)
            ema.update(net)
            if is_main and it % cfg.log_every == 0:
                print(f"ep {epoch} {it}/{n_iter} loss {loss.item():.4f} gnorm {gnorm:.2f} "
                      f"lr {optimizer.param_groups[0]['lr']:.2e}", flush=True)

        metrics = evaluate(net, val_loader, device)
        ema_metrics = evaluate(ema.module, val_loader, device)
        if is_main:
            rec = {"epoch": epoch, **metrics, **{"ema_" + k: v for k, v in ema_metrics.items()},
                   "epoch_time_min": (time.time() - tic) / 60}
            print(json.dumps(rec), flush=True)
            with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a") as fh:
                fh.write(json.dumps(rec) + "\n")
            torch.save({"model": net.state_dict(), "ema": ema.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "epoch": epoch,
                        "config": dataclasses.asdict(cfg)}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
