"""ViT-S/16 on ImageNet-100 with Lion vs AdamW (optimizer comparison).

    torchrun --nproc_per_node=8 lion_vit.py --opt lion --lr 1e-4 --wd 1.0
    torchrun --nproc_per_node=8 lion_vit.py --opt adamw --lr 1e-3 --wd 0.1
"""
import argparse
import math
import os
import time
from dataclasses import asdict, dataclass

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from lion_pytorch import Lion
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets


@dataclass
class Config:
    data: str = "/datasets/imagenet100"
    out: str = "runs/vit_s_lion"
    model: str = "vit_small_patch16_224"
    opt: str = "lion"
    lr: float = 1e-4  # peak LR at the global batch (8 x 128)
    wd: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.99
    epochs: int = 300
    warmup_epochs: int = 20
    batch_size: int = 128
    clip_grad: float = 1.0
    mixup: float = 0.8
    cutmix: float = 1.0
    smoothing: float = 0.1
    workers: int = 10
    log_interval: int = 50


def parse_config():
    cfg = Config()
    ap = argparse.ArgumentParser()
    for k, v in asdict(cfg).items():
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=v)
    return Config(**vars(ap.parse_args()))


def param_groups(model, wd):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or n.endswith(("pos_embed", "cls_token")) else decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(cfg, model):
    groups = param_groups(model, cfg.wd)
    if cfg.opt == "lion":
        return Lion(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    if cfg.opt == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, 0.999))
    raise ValueError(cfg.opt)


def lr_schedule(step, total, warmup, base):
    if step < warmup:
        return base * step / warmup
    return base * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    t = torch.zeros(3, device=device)
    for img, tgt in loader:
        img, tgt = img.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(img)
        t[0] += nn.functional.cross_entropy(logits.float(), tgt, reduction="sum")
        t[1] += (logits.argmax(-1) == tgt).sum()
        t[2] += tgt.numel()
    dist.all_reduce(t)
    return (t[0] / t[2]).item(), (100.0 * t[1] / t[2]).item()


def main():
    cfg = parse_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    master = rank == 0

    train_tf = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic")
    val_tf = create_transform(224, is_training=False, interpolation="bicubic")
    train_set = datasets.ImageFolder(os.path.join(cfg.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(cfg.data, "val"), val_tf)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, cfg.batch_size, sampler=train_sampler, num_workers=cfg.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, 256, sampler=val_sampler, num_workers=cfg.workers, pin_memory=True)

    mixup = Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, label_smoothing=cfg.smoothing,
                  num_classes=len(train_set.classes))
    criterion = SoftTargetCrossEntropy()

    model = timm.create_model(cfg.model, num_classes=len(train_set.classes), drop_path_rate=0.1).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = build_optimizer(cfg, model.module)

    steps_per_epoch = len(train_loader)
    total_steps = cfg.epochs * steps_per_epoch
    warmup_steps = cfg.warmup_epochs * steps_per_epoch

    ckpt_file = os.path.join(cfg.out, "checkpoint.pth")
    start_epoch = 0
    if os.path.isfile(ckpt_file):
        ck = torch.load(ckpt_file, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        start_epoch = ck["epoch"] + 1
        if master:
            print(f"resuming at epoch {start_epoch}")
    if master:
        os.makedirs(cfg.out, exist_ok=True)
        print(f"{cfg.model} opt={cfg.opt} world={world} global_batch={cfg.batch_size * world}")

    best = 0.0
    for epoch in range(start_epoch, cfg.epochs):
        model.train()
        tic = time.time()
        for it, (img, tgt) in enumerate(train_loader):
            step = epoch * steps_per_epoch + it
            lr = lr_schedule(step, total_steps, warmup_steps, cfg.lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            img, tgt = img.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            img, soft_tgt = mixup(img, tgt)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(img)
            loss = criterion(logits.float(), soft_tgt)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
            optimizer.step()

            if master and it % cfg.log_interval == 0:
                print(f"ep {epoch} it {it}/{steps_per_epoch} loss {loss.item():.4f} "
                      f"gn {grad_norm.item():.3f} lr {lr:.2e} {(time.time() - tic) / (it + 1):.3f}s/it", flush=True)

        val_loss, acc = evaluate(model, val_loader, device)
        best = max(best, acc)
        if master:
            print(f"== epoch {epoch}: val loss {val_loss:.4f} top1 {acc:.2f} best {best:.2f}", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch, "cfg": asdict(cfg)}, ckpt_file)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
