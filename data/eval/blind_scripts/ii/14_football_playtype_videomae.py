"""American-football play-type recognition (run / pass / punt / field goal /
kickoff / extra point / kneel / no play) from the broadcast all-22 feed.

Full games are cut at the snap annotations into per-play segments; 16 frames
are sampled from the first `--play-sec` seconds after the snap. Backbone is
VideoMAE-Base fine-tuned on Kinetics-400 (Hugging Face transformers).

    torchrun --nproc_per_node=8 14_football_playtype_videomae.py --plays plays.parquet --video-dir /data/nfl/games
    # resume after preemption
    torchrun --nproc_per_node=8 14_football_playtype_videomae.py ... --resume runs/playtype/last.ckpt
"""
import argparse
import contextlib
import logging
import math
import os
import time

import av
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import VideoMAEForVideoClassification, VideoMAEImageProcessor

PLAY_TYPES = ["run", "pass", "punt", "field_goal", "kickoff", "extra_point", "kneel", "no_play"]
CKPT_NAME = "MCG-NJU/videomae-base-finetuned-kinetics"
logger = logging.getLogger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--plays", required=True, help="parquet: game_id, video, snap_sec, play_type, season")
    p.add_argument("--video-dir", required=True)
    p.add_argument("--val-season", type=int, default=2023)
    p.add_argument("--play-sec", type=float, default=6.0)
    p.add_argument("--num-frames", type=int, default=16)
    p.add_argument("--per-device-batch", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=5e-4, help="lr per 256 samples (scaled to the effective batch)")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--output-dir", default="runs/playtype")
    p.add_argument("--resume", default=None)
    return p.parse_args()


def decode_segment(path, start_sec, dur_sec, n):
    with av.open(path) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        container.seek(int(start_sec / stream.time_base), stream=stream, backward=True)
        frames = []
        for frame in container.decode(stream):
            t = float(frame.pts * stream.time_base)
            if t < start_sec:
                continue
            if t > start_sec + dur_sec:
                break
            frames.append(frame.to_ndarray(format="rgb24"))
    idx = np.linspace(0, len(frames) - 1, n).round().astype(int)
    return [frames[i] for i in idx]


class Plays(Dataset):
    def __init__(self, df, video_dir, processor, num_frames, play_sec, train):
        self.df = df.reset_index(drop=True)
        self.video_dir, self.proc = video_dir, processor
        self.n, self.sec, self.train = num_frames, play_sec, train

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        start = r.snap_sec - 0.5 + (np.random.uniform(-0.5, 0.5) if self.train else 0.0)
        frames = decode_segment(os.path.join(self.video_dir, r.video), max(0.0, start), self.sec, self.n)
        if self.train and np.random.rand() < 0.5:
            frames = [f[:, ::-1].copy() for f in frames]
        pixels = self.proc(frames, return_tensors="pt")["pixel_values"][0]
        return pixels, PLAY_TYPES.index(r.play_type)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s %(message)s")

    plays = pd.read_parquet(args.plays)
    train_df = plays[plays.season != args.val_season]
    val_df = plays[plays.season == args.val_season]
    processor = VideoMAEImageProcessor.from_pretrained(CKPT_NAME)
    train_ds = Plays(train_df, args.video_dir, processor, args.num_frames, args.play_sec, train=True)
    val_ds = Plays(val_df, args.video_dir, processor, args.num_frames, args.play_sec, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=42)
    train_dl = DataLoader(train_ds, batch_size=args.per_device_batch, sampler=sampler, num_workers=10,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                        batch_size=args.per_device_batch, num_workers=10)

    model = VideoMAEForVideoClassification.from_pretrained(
        CKPT_NAME, num_labels=len(PLAY_TYPES), ignore_mismatched_sizes=True,
        label2id={p: i for i, p in enumerate(PLAY_TYPES)}, id2label=dict(enumerate(PLAY_TYPES)))
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    eff_batch = args.per_device_batch * args.grad_accum * world
    lr = args.lr * eff_batch / 256
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.05)
    updates_per_epoch = len(train_dl) // args.grad_accum
    total, warm = args.epochs * updates_per_epoch, updates_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm))))

    start_epoch, best_acc = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]
        logger.info("resumed from %s (epoch %d)", args.resume, ckpt["epoch"])

    os.makedirs(args.output_dir, exist_ok=True)
    logger.info("train %d / val %d plays, effective batch %d, lr %.2e", len(train_ds), len(val_ds), eff_batch, lr)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (pixels, labels) in enumerate(train_dl):
            if step >= updates_per_epoch * args.grad_accum:
                break
            pixels, labels = pixels.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            last_micro = (step + 1) % args.grad_accum == 0
            ctx = model.no_sync() if not last_micro else contextlib.nullcontext()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(pixel_values=pixels).logits
                loss = F.cross_entropy(logits.float(), labels, label_smoothing=0.1) / args.grad_accum
                loss.backward()
            if last_micro:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            if step % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f lr %.2e", epoch, step, len(train_dl),
                            loss.item() * args.grad_accum, sched.get_last_lr()[0])

        model.eval()
        correct = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for pixels, labels in val_dl:
                logits = model.module(pixel_values=pixels.to(device)).logits
                correct += torch.tensor([(logits.argmax(-1).cpu() == labels).sum().item(), len(labels)],
                                        device=device, dtype=torch.float)
        dist.all_reduce(correct)
        acc = (correct[0] / correct[1]).item()
        logger.info("epoch %d done in %.0fs, val acc %.4f", epoch, time.time() - t0, acc)

        if rank == 0:
            best_acc = max(best_acc, acc)
            state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                     "scheduler": sched.state_dict(), "epoch": epoch, "best_acc": best_acc}
            torch.save(state, os.path.join(args.output_dir, "last.ckpt"))
            if acc >= best_acc:
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
