"""ViT-B/16 from scratch on ImageNet-1k with FusedLAMB at 16k global batch.

Benchmark config for the 'large batch ViT' row of the internal perf table.
    torchrun --nproc_per_node=8 05_vit_b16_fusedlamb.py --config configs/vit_b16_lamb.yaml
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import timm
from apex.optimizers import FusedLAMB
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.optim.optim_factory import param_groups_weight_decay
from timm.utils import ModelEmaV2
from torchvision.datasets import ImageFolder

DEFAULTS = dict(
    data="/datasets/imagenet",
    model="vit_base_patch16_224",
    epochs=300,
    batch_size=256,          # per GPU
    accum_steps=8,           # 8 GPUs x 256 x 8 = 16384
    lr=1e-3,                 # per 4096 images
    weight_decay=0.05,
    warmup_epochs=20,
    min_lr=1e-6,
    clip_grad=1.0,
    drop_path=0.1,
    mixup=0.8,
    cutmix=1.0,
    smoothing=0.1,
    ema_decay=0.99996,
    workers=10,
    out_dir="/checkpoints/vit_b16_lamb16k",
    log_every=25,
)


def load_config():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    parser.add_argument("--resume", default="")
    cli = parser.parse_args()
    cfg = dict(DEFAULTS)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    cfg["resume"] = cli.resume
    return argparse.Namespace(**cfg)


def cosine_lr(step, total, warmup, peak, floor):
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * t))


def make_loaders(cfg):
    train_tf = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic")
    eval_tf = create_transform(224, is_training=False, crop_pct=0.875, interpolation="bicubic")
    train_ds = ImageFolder(os.path.join(cfg.data, "train"), transform=train_tf)
    val_ds = ImageFolder(os.path.join(cfg.data, "val"), transform=eval_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, cfg.batch_size, sampler=train_sampler, drop_last=True,
                          num_workers=cfg.workers, pin_memory=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, 256, sampler=val_sampler, num_workers=cfg.workers,
                        pin_memory=True)
    return train_dl, val_dl, train_sampler


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    hits = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in loader:
        x = x.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = net(x).argmax(-1)
        hits[0] += (pred == y).sum()
        hits[1] += y.numel()
    dist.all_reduce(hits)
    return (100.0 * hits[0] / hits[1]).item()


def main():
    cfg = load_config()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1000 + rank)
    torch.backends.cuda.matmul.allow_tf32 = True

    train_dl, val_dl, train_sampler = make_loaders(cfg)

    model = timm.create_model(cfg.model, num_classes=1000, drop_path_rate=cfg.drop_path)
    model.to(device).to(memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank], bucket_cap_mb=100)
    ema = ModelEmaV2(model.module, decay=cfg.ema_decay)

    eff_batch = cfg.batch_size * cfg.accum_steps * world
    peak_lr = cfg.lr * eff_batch / 4096
    param_groups = param_groups_weight_decay(model, cfg.weight_decay,
                                             no_weight_decay_list=model.no_weight_decay())
    optimizer = FusedLAMB(param_groups, lr=peak_lr, betas=(0.9, 0.999), eps=1e-6,
                          max_grad_norm=cfg.clip_grad)
    mixup = Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix,
                  label_smoothing=cfg.smoothing, num_classes=1000)
    criterion = SoftTargetCrossEntropy()

    updates_per_epoch = len(train_dl) // cfg.accum_steps
    total_updates = updates_per_epoch * cfg.epochs
    warmup_updates = updates_per_epoch * cfg.warmup_epochs

    start_epoch = 0
    if cfg.resume:
        ckpt = torch.load(cfg.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        ema.module.load_state_dict(ckpt["ema"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"] + 1

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        print(f"effective batch {eff_batch}, peak lr {peak_lr:.2e}, "
              f"{updates_per_epoch} updates/epoch", flush=True)

    for epoch in range(start_epoch, cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        for i, (x, y) in enumerate(train_dl):
            update = epoch * updates_per_epoch + i // cfg.accum_steps
            x = x.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            sync = (i + 1) % cfg.accum_steps == 0
            with (model.no_sync() if not sync else torch.enable_grad()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = criterion(model(x), y) / cfg.accum_steps
                loss.backward()
            if not sync:
                continue

            lr = cosine_lr(update, total_updates, warmup_updates, peak_lr, cfg.min_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            ema.update(model.module)

            if rank == 0 and (i // cfg.accum_steps) % cfg.log_every == 0:
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                print(f"ep {epoch} upd {update} loss {loss.item() * cfg.accum_steps:.4f} "
                      f"lr {lr:.2e} {(i + 1) * cfg.batch_size * world / dt:.0f} img/s", flush=True)

        acc = evaluate(model, val_dl, device)
        acc_ema = evaluate(ema.module, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch}: top1 {acc:.2f} | ema {acc_ema:.2f}", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "ema": ema.module.state_dict(), "optimizer": optimizer.state_dict()},
                       os.path.join(cfg.out_dir, "checkpoint.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
