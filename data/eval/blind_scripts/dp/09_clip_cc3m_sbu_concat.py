"""CLIP ViT-B/32 on CC3M + SBU (concatenated csv datasets), small-lab reproduction.

    torchrun --nproc_per_node=4 09_clip_cc3m_sbu_concat.py --config configs/b32_cc3m_sbu.json
"""
import argparse
import dataclasses
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import List

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image, ImageFile
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset

import open_clip

ImageFile.LOAD_TRUNCATED_IMAGES = True


@dataclass
class Config:
    model: str = "ViT-B-32"
    train_csvs: List[str] = field(default_factory=lambda: ["/data/cc3m/train.csv", "/data/sbu/sbu.csv"])
    val_csv: str = "/data/cc3m/val.csv"
    batch_size: int = 256
    epochs: int = 40
    lr: float = 5e-4
    weight_decay: float = 0.2
    warmup_steps: int = 2000
    grad_clip: float = 1.0
    workers: int = 8
    seed: int = 42
    out_dir: str = "experiments/b32_cc3m_sbu"
    eval_every: int = 1


class ImageCaptionCsv(Dataset):
    def __init__(self, csv_path, transform, tokenizer):
        df = pd.read_csv(csv_path)
        self.paths = df["image"].tolist()
        self.captions = df["caption"].tolist()
        self.transform = transform
        self.tokenizer = tokenizer

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, idx):
        image = Image.open(self.paths[idx]).convert("RGB")
        return self.transform(image), self.tokenizer(str(self.captions[idx]))[0]


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def gather_all(t, world_size, rank):
    parts = [torch.zeros_like(t) for _ in range(world_size)]
    dist.all_gather(parts, t)
    parts[rank] = t
    return torch.cat(parts)


def clip_loss(img, txt, scale, world_size, rank):
    img_all = gather_all(img, world_size, rank)
    txt_all = gather_all(txt, world_size, rank)
    logits_i = scale * img @ txt_all.t()
    logits_t = scale * txt @ img_all.t()
    target = torch.arange(img.shape[0], device=img.device) + rank * img.shape[0]
    return 0.5 * (F.cross_entropy(logits_i, target) + F.cross_entropy(logits_t, target))


@torch.no_grad()
def validate(model, loader, device):
    """Contrastive loss + R@1 within each val batch (rank 0, single GPU)."""
    model.eval()
    losses, r1 = [], []
    for images, texts in loader:
        img, txt, scale = model(images.to(device), texts.to(device))
        logits = scale * img @ txt.t()
        target = torch.arange(len(logits), device=device)
        losses.append(0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)).item())
        r1.append((logits.argmax(1) == target).float().mean().item())
    model.train()
    return float(np.mean(losses)), float(np.mean(r1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cli = ap.parse_args()
    cfg = Config()
    if cli.config:
        with open(cli.config) as f:
            cfg = dataclasses.replace(cfg, **json.load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_everything(cfg.seed + rank)

    model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(cfg.model)
    model = model.to(device)
    tokenizer = open_clip.get_tokenizer(cfg.model)
    ddp_model = DDP(model, device_ids=[local_rank])

    train_set = ConcatDataset([ImageCaptionCsv(p, preprocess_train, tokenizer) for p in cfg.train_csvs])
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True, num_workers=cfg.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = None
    if rank == 0:
        val_loader = DataLoader(ImageCaptionCsv(cfg.val_csv, preprocess_val, tokenizer),
                                batch_size=256, num_workers=4, drop_last=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "logit_scale" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "logit_scale" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=cfg.lr, betas=(0.9, 0.98), eps=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    steps_per_epoch = len(train_loader)
    total_steps = cfg.epochs * steps_per_epoch

    def lr_lambda(step):
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        return 0.5 * (1.0 + math.cos(math.pi * (step - cfg.warmup_steps) / (total_steps - cfg.warmup_steps)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)
        print(f"train pairs: {len(train_set)}  steps/epoch: {steps_per_epoch}  world: {world_size}")

    best_r1 = 0.0
    for epoch in range(cfg.epochs):
        ddp_model.train()
        start = time.time()
        for step, (images, texts) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            texts = texts.to(device, non_blocking=True)
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                img, txt, scale = ddp_model(images, texts)
                loss = clip_loss(img, txt, scale, world_size, rank)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))

            if rank == 0 and step % 100 == 0:
                el = time.time() - start
                print(f"epoch {epoch:3d} step {step:6d}/{steps_per_epoch} loss {loss.item():.4f} "
                      f"scale {scale.item():6.2f} lr {scheduler.get_last_lr()[0]:.2e} "
                      f"{(step + 1) * cfg.batch_size * world_size / el:.0f} img/s", flush=True)

        if rank == 0 and (epoch + 1) % cfg.eval_every == 0:
            val_loss, val_r1 = validate(model, val_loader, device)
            print(f"epoch {epoch} val loss {val_loss:.4f} in-batch R@1 {val_r1:.4f}", flush=True)
            ckpt = {"epoch": epoch + 1, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(), "config": dataclasses.asdict(cfg)}
            torch.save(ckpt, os.path.join(cfg.out_dir, "last.pt"))
            if val_r1 > best_r1:
                best_r1 = val_r1
                torch.save(ckpt, os.path.join(cfg.out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
