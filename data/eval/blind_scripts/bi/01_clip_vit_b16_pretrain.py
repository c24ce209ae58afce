#!/usr/bin/env python
"""CLIP ViT-B/16 contrastive pre-training on image/text pairs listed in parquet shards.

Each parquet shard has two columns: `filepath` (relative to --image-root) and `caption`.
One process per GPU, launched with torchrun.
"""
import argparse
import glob
import json
import logging
import math
import os
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import open_clip

logger = logging.getLogger("clip_pretrain")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-shards", required=True, help="glob of parquet files")
    p.add_argument("--val-shards", default=None)
    p.add_argument("--image-root", required=True)
    p.add_argument("--model", default="ViT-B-16")
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--epochs", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--wd", type=float, default=0.2)
    p.add_argument("--warmup-steps", type=int, default=2000)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--output-dir", default="./runs/clip_b16")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class ParquetPairs(Dataset):
    def __init__(self, pattern, image_root, transform, tokenizer):
        files = sorted(glob.glob(pattern))
        if not files:
            raise FileNotFoundError(pattern)
        df = pd.concat([pd.read_parquet(f, columns=["filepath", "caption"]) for f in files])
        self.paths = df["filepath"].tolist()
        self.captions = df["caption"].astype(str).tolist()
        self.image_root = image_root
        self.transform = transform
        self.tokenizer = tokenizer

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.image_root, self.paths[i])).convert("RGB")
        tokens = self.tokenizer([self.captions[i]])[0]
        return self.transform(img), tokens


def gather_features(image_features, text_features):
    """All-gather features from every rank; the local slice keeps its autograd graph."""
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    all_img = [torch.zeros_like(image_features) for _ in range(world_size)]
    all_txt = [torch.zeros_like(text_features) for _ in range(world_size)]
    dist.all_gather(all_img, image_features)
    dist.all_gather(all_txt, text_features)
    all_img[rank] = image_features
    all_txt[rank] = text_features
    return torch.cat(all_img), torch.cat(all_txt)


def clip_loss(image_features, text_features, logit_scale):
    all_img, all_txt = gather_features(image_features, text_features)
    logits_per_image = logit_scale * all_img @ all_txt.t()
    logits_per_text = logits_per_image.t()
    labels = torch.arange(all_img.shape[0], device=all_img.device)
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2


def cosine_lr(optimizer, base_lr, warmup, total):
    def _step(step):
        if step < warmup:
            lr = base_lr * (step + 1) / warmup
        else:
            progress = (step - warmup) / max(1, total - warmup)
            lr = 0.5 * (1 + math.cos(math.pi * progress)) * base_lr
        for g in optimizer.param_groups:
            g["lr"] = lr
        return lr
    return _step


@torch.no_grad()
def evaluate(model, loader, device):
    """Mean contrastive loss on the validation split (averaged over ranks)."""
    model.eval()
    total = torch.zeros(2, device=device)
    for images, texts in loader:
        images = images.to(device, non_blocking=True)
        texts = texts.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            img_f, txt_f, scale = model(images, texts)
            loss = clip_loss(img_f, txt_f, scale)
        total[0] += loss.float() * images.shape[0]
        total[1] += images.shape[0]
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)

    model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(args.model)
    tokenizer = open_clip.get_tokenizer(args.model)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    train_ds = ParquetPairs(args.train_shards, args.image_root, preprocess_train, tokenizer)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = None
    if args.val_shards:
        val_ds = ParquetPairs(args.val_shards, args.image_root, preprocess_val, tokenizer)
        val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
        val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler,
                                num_workers=args.workers, pin_memory=True, drop_last=True)

    # no weight decay on gains, biases, embeddings and the logit scale
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n or "embedding" in n:
            no_decay.append(p)
        else:
            decay.append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    steps_per_epoch = len(train_loader)
    total_steps = steps_per_epoch * args.epochs
    schedule = cosine_lr(optimizer, args.lr, args.warmup_steps, total_steps)

    if is_main:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
        logger.info("world size %d, global batch %d, %d steps/epoch",
                    world_size, args.batch_size * world_size, steps_per_epoch)

    step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for i, (images, texts) in enumerate(train_loader):
            lr = schedule(step)
            images = images.to(device, non_blocking=True)
            texts = texts.to(device, non_blocking=True)

            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                img_f, txt_f, logit_scale = model(images, texts)
                loss = clip_loss(img_f, txt_f, logit_scale)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()

            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))

            step += 1
            if is_main and i % args.log_every == 0:
                dt = (time.time() - t0) / (i + 1)
                logger.info("ep %d it %d/%d loss %.4f scale %.2f lr %.2e %.3fs/it",
                            epoch, i, steps_per_epoch, loss.item(), logit_scale.item(), lr, dt)

        if val_loader is not None:
            val_loss = evaluate(model.module, val_loader, device)
            if is_main:
                logger.info("epoch %d val_loss %.4f", epoch, val_loss)

        if is_main:
            ckpt = {
                "epoch": epoch + 1,
                "step": step,
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),
            }
            torch.save(ckpt, os.path.join(args.output_dir, f"epoch_{epoch + 1}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
