#!/usr/bin/env python3
# CLIP ViT-B/16 pretraining on LAION shards with a held-out COCO caption val loss.
# Usage:
#   torchrun --nproc_per_node=8 04_clip_val_loss_coco.py \
#       --train-data "/mnt/laion/{00000..09999}.tar" --val-csv /mnt/coco/val2017_captions.csv
import argparse
import json
import math
import os
import time

import braceexpand
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import webdataset as wds
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import open_clip

try:
    import wandb
except ImportError:
    wandb = None


class ClipLoss(nn.Module):
    """Contrastive loss over the global batch (features from every rank)."""

    def __init__(self, world_size, rank):
        super().__init__()
        self.world_size = world_size
        self.rank = rank

    def forward(self, image_features, text_features, logit_scale):
        if self.world_size > 1:
            img_list = [torch.empty_like(image_features) for _ in range(self.world_size)]
            txt_list = [torch.empty_like(text_features) for _ in range(self.world_size)]
            dist.all_gather(img_list, image_features.contiguous())
            dist.all_gather(txt_list, text_features.contiguous())
            img_list[self.rank] = image_features
            txt_list[self.rank] = text_features
            image_features = torch.cat(img_list)
            text_features = torch.cat(txt_list)
        logits = logit_scale * image_features @ text_features.T
        target = torch.arange(logits.shape[0], device=logits.device)
        return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))


class CaptionCsv(Dataset):
    def __init__(self, csv_path, transform, tokenizer):
        self.df = pd.read_csv(csv_path)
        self.transform = transform
        self.tokenizer = tokenizer

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        row = self.df.iloc[i]
        img = self.transform(Image.open(row["filepath"]).convert("RGB"))
        return img, self.tokenizer([row["caption"]])[0]


def wds_loader(args, preprocess, tokenizer, world_size):
    urls = list(braceexpand.braceexpand(args.train_data))
    global_batch = args.batch_size * world_size
    num_batches = math.ceil(args.train_num_samples / global_batch)
    per_worker = math.ceil(num_batches / args.workers)
    num_batches = per_worker * args.workers
    pipe = wds.DataPipeline(
        wds.ResampledShards(urls),
        wds.tarfile_to_samples(handler=wds.warn_and_continue),
        wds.shuffle(bufsize=5000, initial=1000),
        wds.decode("pilrgb", handler=wds.warn_and_continue),
        wds.rename(image="jpg;png;jpeg;webp", text="txt"),
        wds.map_dict(image=preprocess, text=lambda t: tokenizer(t)[0]),
        wds.to_tuple("image", "text"),
        wds.batched(args.batch_size, partial=False),
    ).with_epoch(per_worker)
    loader = wds.WebLoader(pipe, batch_size=None, shuffle=False, num_workers=args.workers,
                           persistent_workers=args.workers > 0)
    return loader, num_batches


@torch.no_grad()
def evaluate(model, loader, loss_fn, device):
    model.eval()
    total, count = 0.0, 0
    for images, texts in loader:
        images = images.to(device, non_blocking=True)
        texts = texts.to(device, non_blocking=True)
        with torch.autocast("cuda"):
            img_f, txt_f, scale = model(images, texts)
            loss = loss_fn(img_f, txt_f, scale)
        total += loss.item() * images.shape[0]
        count += images.shape[0]
    model.train()
    return total / max(count, 1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-data", required=True)
    parser.add_argument("--train-num-samples", type=int, default=100_000_000)
    parser.add_argument("--val-csv", default=None)
    parser.add_argument("--model", default="ViT-B-16")
    parser.add_argument("--batch-size", type=int, default=320)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--wd", type=float, default=0.2)
    parser.add_argument("--warmup", type=int, default=10000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--report-to", default="")
    parser.add_argument("--name", default="vitb16_laion100m")
    parser.add_argument("--logs", default="./logs")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    is_master = rank == 0
    device = torch.device("cuda", local_rank)

    model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(args.model, device=device)
    tokenizer = open_clip.get_tokenizer(args.model)
    ddp_model = DDP(model, device_ids=[local_rank], static_graph=True)

    params_wd = [p for n, p in model.named_parameters() if p.ndim >= 2 and "logit_scale" not in n]
    params_no_wd = [p for n, p in model.named_parameters() if p.ndim < 2 or "logit_scale" in n]
    optimizer = torch.optim.AdamW([{"params": params_no_wd, "weight_decay": 0.0},
                                   {"params": params_wd, "weight_decay": args.wd}],
                                  lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    scaler = torch.cuda.amp.GradScaler()

    train_loader, steps_per_epoch = wds_loader(args, preprocess_train, tokenizer, world_size)
    total_steps = steps_per_epoch * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (s + 1) / args.warmup if s < args.warmup
        else 0.5 * (1 + math.cos(math.pi * (s - args.warmup) / (total_steps - args.warmup))),
    )
    loss_fn = ClipLoss(world_size, rank)

    val_loader = None
    if args.val_csv:
        val_ds = CaptionCsv(args.val_csv, preprocess_val, tokenizer)
        val_loader = DataLoader(val_ds, batch_size=args.batch_size, num_workers=4, drop_last=True)

    run_dir = os.path.join(args.logs, args.name)
    if is_master:
        os.makedirs(run_dir, exist_ok=True)
        if "wandb" in args.report_to and wandb is not None:
            wandb.init(project="clip-repro", name=args.name, config=vars(args))

    step = 0
    for epoch in range(args.epochs):
        ddp_model.train()
        t_data = time.time()
        for batch_idx, (images, texts) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            texts = texts.to(device, non_blocking=True)
            with torch.autocast("cuda"):
                img_f, txt_f, scale = ddp_model(images, texts)
                loss = loss_fn(img_f, txt_f, scale)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            sched.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
            step += 1

            if is_master and step % 100 == 0:
                msg = {"loss": loss.item(), "scale": scale.item(), "lr": sched.get_last_lr()[0],
                       "step_time": (time.time() - t_data) / 100}
                print(f"epoch {epoch} step {step} {msg}", flush=True)
                if wandb is not None and wandb.run is not None:
                    wandb.log(msg, step=step)
                t_data = time.time()

        if is_master:
            if val_loader is not None:
                val_loss = evaluate(model, val_loader, loss_fn, device)
                print(f"epoch {epoch} val_loss {val_loss:.4f}", flush=True)
                with open(os.path.join(run_dir, "val.jsonl"), "a") as f:
                    f.write(json.dumps({"epoch": epoch, "val_loss": val_loss}) + "\n")
                if wandb is not None and wandb.run is not None:
                    wandb.log({"val_loss": val_loss}, step=step)
            torch.save({"epoch": epoch + 1, "state_dict": model.state_dict(),
                        "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()},
                       os.path.join(run_dir, f"epoch_{epoch + 1}.pt"))
        dist.barrier()

    if is_master and wandb is not None and wandb.run is not None:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
