#!/usr/bin/env python
# ViT-S/16 on ImageNet stored as webdataset tar shards, GPU augmentation with kornia.
#
#   torchrun --nnodes=$NNODES --nproc_per_node=8 --rdzv_backend=c10d \
#       --rdzv_endpoint=$HEAD:29500 02_wds_vit_resampled.py --config vit_s.yaml
import argparse
import math
import os
import time

import kornia.augmentation as K
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
import webdataset as wds
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)

DEFAULTS = dict(
    train_shards="/datasets/imagenet-wds/train/imagenet-train-{000000..001281}.tar",
    val_shards="/datasets/imagenet-wds/val/imagenet-val-{000000..000049}.tar",
    train_samples=1281167,
    model="vit_small_patch16_224",
    epochs=300,
    batch_size=128,          # per GPU
    base_lr=5e-4,            # for a global batch of 512
    min_lr=1e-5,
    weight_decay=0.05,
    warmup_epochs=5,
    workers=8,
    drop_path=0.1,
    out_dir="/shared/runs/vit_s_wds",
    log_every=100,
)


def load_config():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="")
    args = p.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    return argparse.Namespace(**cfg)


cpu_preprocess = T.Compose([T.Resize(256), T.CenterCrop(256), T.PILToTensor()])
val_preprocess = T.Compose([T.Resize(256), T.CenterCrop(224), T.PILToTensor()])


def identity(x):
    return x


def make_train_loader(cfg, world_size):
    # Shards are resampled with replacement on every rank and worker, so no
    # node splitter is used; with_epoch fixes the number of steps per rank.
    dataset = (
        wds.WebDataset(cfg.train_shards, resampled=True, handler=wds.warn_and_continue)
        .shuffle(5000)
        .decode("pil", handler=wds.warn_and_continue)
        .to_tuple("jpg;jpeg;png", "cls", handler=wds.warn_and_continue)
        .map_tuple(cpu_preprocess, identity)
        .batched(cfg.batch_size, partial=False)
    )
    global_batch = cfg.batch_size * world_size
    steps_per_epoch = cfg.train_samples // global_batch
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=cfg.workers,
                           pin_memory=True, persistent_workers=True)
    return loader.with_epoch(steps_per_epoch), steps_per_epoch


def make_val_loader(cfg):
    dataset = (
        wds.WebDataset(cfg.val_shards, shardshuffle=False, nodesplitter=wds.split_by_node)
        .decode("pil")
        .to_tuple("jpg;jpeg;png", "cls")
        .map_tuple(val_preprocess, identity)
        .batched(256, partial=True)
    )
    return wds.WebLoader(dataset, batch_size=None, num_workers=4, pin_memory=True)


def cosine_lr(step, total, warmup, base, minimum):
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return minimum + 0.5 * (base - minimum) * (1.0 + math.cos(math.pi * t))


@torch.no_grad()
def evaluate(net, loader, normalize, device):
    # Shards are split by node, so ranks see different numbers of batches.
    # The bare module is used here and counts are summed once at the end.
    net.eval()
    stats = torch.zeros(3, device=device)  # loss_sum, correct, count
    for images, labels in loader:
        images = images.to(device, non_blocking=True).float().div_(255)
        labels = labels.to(device, non_blocking=True)
        images = normalize(images)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(images)
        stats[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        stats[1] += (logits.argmax(-1) == labels).sum()
        stats[2] += labels.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item() * 100


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0

    train_loader, steps_per_epoch = make_train_loader(cfg, world_size)
    val_loader = make_val_loader(cfg)

    gpu_aug = nn.Sequential(
        K.RandomResizedCrop((224, 224), scale=(0.08, 1.0)),
        K.RandomHorizontalFlip(),
        K.ColorJitter(0.4, 0.4, 0.4, 0.1, p=0.8),
        K.RandomGrayscale(p=0.2),
    ).to(device)
    normalize = K.Normalize(mean=torch.tensor(MEAN), std=torch.tensor(STD)).to(device)

    model = timm.create_model(cfg.model, num_classes=1000, drop_path_rate=cfg.drop_path).to(device)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or name.endswith(".bias") or "pos_embed" in name or "cls_token" in name
         else decay).append(p)
    model = DDP(model, device_ids=[local_rank])

    peak_lr = cfg.base_lr * cfg.batch_size * world_size / 512
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=peak_lr, betas=(0.9, 0.999),
    )

    os.makedirs(cfg.out_dir, exist_ok=True)
    ckpt_path = os.path.join(cfg.out_dir, "checkpoint.pt")
    start_epoch = 0
    if os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
        if is_main:
            print(f"resumed from epoch {state['epoch']}")

    writer = None
    if is_main:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(os.path.join(cfg.out_dir, "tb"))

    total_steps = cfg.epochs * steps_per_epoch
    warmup_steps = cfg.warmup_epochs * steps_per_epoch
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    for epoch in range(start_epoch, cfg.epochs):
        model.train()
        t0 = time.time()
        for it, (images, labels) in enumerate(train_loader):
            step = epoch * steps_per_epoch + it
            lr = cosine_lr(step, total_steps, warmup_steps, peak_lr, cfg.min_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr

            images = images.to(device, non_blocking=True).float().div_(255)
            labels = labels.to(device, non_blocking=True)
            with torch.no_grad():
                images = normalize(gpu_aug(images))

            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()

            if it % cfg.log_every == 0:
                logged = loss.detach()
                dist.all_reduce(logged, op=dist.ReduceOp.AVG)
                if is_main:
                    thr = (it + 1) * cfg.batch_size * world_size / (time.time() - t0)
                    print(f"ep {epoch} it {it}/{steps_per_epoch} loss {logged.item():.4f} lr {lr:.2e} {thr:.0f} img/s")
                    writer.add_scalar("train/loss", logged.item(), step)
                    writer.add_scalar("train/lr", lr, step)

        val_loss, val_acc = evaluate(model.module, val_loader, normalize, device)
        if is_main:
            print(f"epoch {epoch}: val loss {val_loss:.4f} top1 {val_acc:.2f}")
            writer.add_scalar("val/top1", val_acc, epoch)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
