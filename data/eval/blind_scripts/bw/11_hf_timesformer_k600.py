"""Fine-tune Hugging Face TimeSformer-base (K400) on Kinetics-600 with plain DDP.

    torchrun --nproc_per_node=8 11_hf_timesformer_k600.py \
        --model /models/timesformer-base-finetuned-k400 \
        --train-csv /data/k600/train.csv --val-csv /data/k600/val.csv --video-dir /data/k600/videos \
        --output-dir /exp/tsf_k600
"""
import argparse
import math
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import TimesformerForVideoClassification, get_cosine_schedule_with_warmup

MEAN = torch.tensor([0.45, 0.45, 0.45]).view(1, 3, 1, 1)
STD = torch.tensor([0.225, 0.225, 0.225]).view(1, 3, 1, 1)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--train-csv", required=True)
    p.add_argument("--val-csv", required=True)
    p.add_argument("--video-dir", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--num-frames", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--warmup-ratio", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=5e-5, help="AdamW lr for a global batch of 32")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--test-clips", type=int, default=3)
    p.add_argument("--test-crops", type=int, default=1)
    return p.parse_args()


class K600(Dataset):
    """csv columns: label,youtube_id,time_start,time_end,split"""

    def __init__(self, csv_path, video_dir, label2id, num_frames, train, clips=1, crops=1, size=224):
        df = pd.read_csv(csv_path)
        self.paths = [os.path.join(video_dir, r.split, f"{r.youtube_id}_{r.time_start:06d}_{r.time_end:06d}.mp4")
                      for r in df.itertuples()]
        self.labels = [label2id[l] for l in df["label"]]
        self.num_frames, self.train, self.clips, self.crops, self.size = num_frames, train, clips, crops, size

    def __len__(self):
        return len(self.paths) * self.clips * self.crops

    def __getitem__(self, idx):
        vid, view = divmod(idx, self.clips * self.crops)
        clip, crop = divmod(view, self.crops)
        vr = VideoReader(self.paths[vid], ctx=cpu(0), num_threads=1)
        n = len(vr)
        # 8 frames covering ~ one third of the video, like the original 8x32 sampling at 30fps
        span = min(n, 8 * 32)
        if self.train:
            s = random.randint(0, n - span)
        else:
            s = int((n - span) * clip / max(1, self.clips - 1))
        ids = np.linspace(s, s + span - 1, self.num_frames).astype(int)
        x = torch.from_numpy(vr.get_batch(ids).asnumpy()).permute(0, 3, 1, 2).float() / 255.0
        h, w = x.shape[-2:]
        if self.train:
            short = random.randint(256, 320)
        else:
            short = self.size
        r = short / min(h, w)
        x = F.interpolate(x, size=(round(h * r), round(w * r)), mode="bilinear", align_corners=False)
        h, w = x.shape[-2:]
        if self.train:
            i, j = random.randint(0, h - self.size), random.randint(0, w - self.size)
        else:
            k = 1 if self.crops == 1 else crop
            i = (h - self.size) * k // 2 if h > w else (h - self.size) // 2
            j = (w - self.size) * k // 2 if w >= h else (w - self.size) // 2
        x = x[..., i:i + self.size, j:j + self.size]
        if self.train and random.random() < 0.5:
            x = x.flip(-1)
        return (x - MEAN) / STD, self.labels[vid], vid  # (T, C, H, W) as HF expects


@torch.no_grad()
def evaluate(model, loader, n_videos, n_classes, device):
    model.eval()
    scores = torch.zeros(n_videos, n_classes, device=device)
    labels = torch.full((n_videos,), -1, dtype=torch.long, device=device)
    for x, y, vid in loader:
        x = x.to(device, non_blocking=True)
        y, vid = y.to(device), vid.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(pixel_values=x).logits
        scores.index_add_(0, vid, logits.float().softmax(-1))
        labels[vid] = y
    seen = labels >= 0
    pred = scores[seen].topk(5, dim=1).indices
    y = labels[seen]
    top1 = (pred[:, 0] == y).float().mean().item() * 100
    top5 = (pred == y[:, None]).any(1).float().mean().item() * 100
    return top1, top5


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(17 + rank)
    random.seed(17 + rank)

    classes = sorted(pd.read_csv(args.train_csv)["label"].unique())
    label2id = {c: i for i, c in enumerate(classes)}
    train_set = K600(args.train_csv, args.video_dir, label2id, args.num_frames, train=True)
    val_set = K600(args.val_csv, args.video_dir, label2id, args.num_frames, train=False,
                   clips=args.test_clips, crops=args.test_crops)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = TimesformerForVideoClassification.from_pretrained(
        args.model, num_labels=len(classes), ignore_mismatched_sizes=True,
        label2id=label2id, id2label={i: c for c, i in label2id.items()})
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 32
    no_decay = ("bias", "layernorm", "LayerNorm", "cls_token", "position_embeddings", "time_embeddings")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)], "weight_decay": 0.05},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=lr)
    total_steps = args.epochs * len(train_loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    best_top1 = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_meter = torch.zeros(2, device=device)
        for step, (x, y, _) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(pixel_values=x).logits
                loss = F.cross_entropy(logits.float(), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            loss_meter += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)
        dist.all_reduce(loss_meter)

        top1, top5 = evaluate(model, val_loader, len(val_set.paths), len(classes), device)
        if rank == 0:
            print(f"epoch {epoch}: train loss {(loss_meter[0] / loss_meter[1]).item():.4f} "
                  f"val top1 {top1:.2f} top5 {top5:.2f} ({args.test_clips}x{args.test_crops} views)", flush=True)
            model.module.save_pretrained(os.path.join(args.output_dir, "last"))
            if top1 > best_top1:
                best_top1 = top1
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))

    if rank == 0:
        print(f"best val top1 {best_top1:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
