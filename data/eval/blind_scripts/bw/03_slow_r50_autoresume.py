"""SlowOnly R50 (8x8) on Kinetics-400, preemptible cluster version.

The job is requeued by the scheduler, so it always auto-resumes from
<work_dir>/latest.pth if that file exists.

    torchrun --standalone --nproc_per_node=8 03_slow_r50_autoresume.py \
        --ann-dir /data/k400/annotations --video-dir /data/k400/videos_320 --work-dir /nfs/exp/slow_r50
"""
import argparse
import logging
import math
import os
import random
import sys

import av
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pytorchvideo.models.resnet import create_resnet
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("slow_r50")

MEAN = np.array([0.45, 0.45, 0.45], dtype=np.float32)
STD = np.array([0.225, 0.225, 0.225], dtype=np.float32)


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ann-dir", required=True)
    parser.add_argument("--video-dir", required=True)
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--num-frames", type=int, default=8)
    parser.add_argument("--stride", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8, help="per GPU")
    parser.add_argument("--epochs", type=int, default=196)
    parser.add_argument("--warmup-epochs", type=int, default=34)
    parser.add_argument("--lr", type=float, default=0.8, help="for the full 64-GPU x 8 batch (512)")
    parser.add_argument("--wd", type=float, default=1e-4)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--eval-period", type=int, default=10)
    parser.add_argument("--ckpt-period", type=int, default=1)
    return parser.parse_args()


def setup_logging(rank):
    handlers = [logging.StreamHandler(sys.stdout)] if rank == 0 else [logging.NullHandler()]
    logging.basicConfig(level=logging.INFO, handlers=handlers,
                        format="[%(asctime)s] %(message)s", datefmt="%m/%d %H:%M:%S")


class KineticsPyAV(Dataset):
    def __init__(self, df, video_dir, label_ids, num_frames, stride, train, crop=224):
        self.df = df.reset_index(drop=True)
        self.video_dir = video_dir
        self.label_ids = label_ids
        self.num_frames, self.stride, self.train, self.crop = num_frames, stride, train, crop

    def __len__(self):
        return len(self.df)

    def _decode(self, path):
        container = av.open(path)
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        container.close()
        return frames

    def __getitem__(self, idx):
        row = self.df.iloc[idx]
        name = f"{row.youtube_id}_{row.time_start:06d}_{row.time_end:06d}.mp4"
        frames = self._decode(os.path.join(self.video_dir, row.split, row.label, name))
        n = len(frames)
        span = self.num_frames * self.stride
        start = random.randint(0, max(0, n - span)) if self.train else max(0, n - span) // 2
        ids = [min(start + i * self.stride, n - 1) for i in range(self.num_frames)]
        clip = np.stack([frames[i] for i in ids]).astype(np.float32) / 255.0
        clip = (clip - MEAN) / STD
        x = torch.from_numpy(clip).permute(0, 3, 1, 2)  # T C H W
        short = random.randint(256, 320) if self.train else 256
        h, w = x.shape[-2:]
        size = (short, int(w * short / h)) if h <= w else (int(h * short / w), short)
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
        h, w = x.shape[-2:]
        if self.train:
            i, j = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
        else:
            i, j = (h - self.crop) // 2, (w - self.crop) // 2
        x = x[..., i:i + self.crop, j:j + self.crop]
        if self.train and random.random() < 0.5:
            x = x.flip(-1)
        return x.permute(1, 0, 2, 3).contiguous(), self.label_ids[row.label]


def build_model(num_classes):
    model = create_resnet(
        input_channel=3,
        model_depth=50,
        model_num_class=num_classes,
        dropout_rate=0.5,
        norm=nn.BatchNorm3d,
        activation=nn.ReLU,
        stem_conv_kernel_size=(1, 7, 7),
        head_pool_kernel_size=(8, 7, 7),
    )
    return model


def lr_at(step, base_lr, warmup_steps, total_steps):
    if step < warmup_steps:
        alpha = step / warmup_steps
        return base_lr * (0.01 * (1 - alpha) + alpha)
    return base_lr * 0.5 * (1 + math.cos(math.pi * (step - warmup_steps) / (total_steps - warmup_steps)))


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    totals = torch.zeros(3, device=device)  # top1 hits, top5 hits, count
    for clips, labels in loader:
        clips, labels = clips.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(clips)
        top5 = logits.topk(5, dim=1).indices
        totals[0] += (top5[:, 0] == labels).sum()
        totals[1] += (top5 == labels[:, None]).any(dim=1).sum()
        totals[2] += labels.numel()
    dist.all_reduce(totals)
    return (100 * totals[0] / totals[2]).item(), (100 * totals[1] / totals[2]).item()


class ValShard(torch.utils.data.Sampler):
    def __init__(self, n, num_replicas, rank):
        self.indices = list(range(n))[rank::num_replicas]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    setup_logging(rank)
    device = torch.device("cuda", local_rank)

    train_df = pd.read_csv(os.path.join(args.ann_dir, "train.csv"))
    val_df = pd.read_csv(os.path.join(args.ann_dir, "validate.csv"))
    train_df["split"], val_df["split"] = "train", "val"
    label_ids = {name: i for i, name in enumerate(sorted(train_df["label"].unique()))}

    train_set = KineticsPyAV(train_df, args.video_dir, label_ids, args.num_frames, args.stride, True)
    val_set = KineticsPyAV(val_df, args.video_dir, label_ids, args.num_frames, args.stride, False)
    train_sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size,
                            sampler=ValShard(len(val_set), world_size, rank),
                            num_workers=args.num_workers, pin_memory=True)

    model = build_model(len(label_ids))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    base_lr = args.lr * args.batch_size * world_size / 512
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=0.9,
                                weight_decay=args.wd, nesterov=True)
    scaler = torch.cuda.amp.GradScaler()
    steps_per_epoch = len(train_loader)
    warmup_steps, total_steps = args.warmup_epochs * steps_per_epoch, args.epochs * steps_per_epoch

    start_epoch = 0
    latest = os.path.join(args.work_dir, "latest.pth")
    if os.path.isfile(latest):
        checkpoint = torch.load(latest)
        model.module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])
        start_epoch = checkpoint["epoch"] + 1
        logger.info("resumed from %s (epoch %d)", latest, checkpoint["epoch"])
        del checkpoint

    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
    logger.info("%d GPUs, %d steps/epoch, base lr %.4f", world_size, steps_per_epoch, base_lr)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        meter = torch.zeros(2, device=device)
        for it, (clips, labels) in enumerate(train_loader):
            step = epoch * steps_per_epoch + it
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, base_lr, warmup_steps, total_steps)
            clips, labels = clips.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(clips), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            meter += torch.stack([loss.detach().float() * labels.numel(),
                                  torch.tensor(float(labels.numel()), device=device)])
            if it % 20 == 0:
                logger.info("epoch %d iter %d/%d loss %.4f lr %.5f", epoch, it, steps_per_epoch,
                            loss.item(), optimizer.param_groups[0]["lr"])
        dist.all_reduce(meter)
        logger.info("epoch %d mean train loss %.4f", epoch, (meter[0] / meter[1]).item())

        if (epoch + 1) % args.eval_period == 0 or epoch + 1 == args.epochs:
            top1, top5 = validate(model.module, val_loader, device)
            logger.info("epoch %d val top1 %.2f top5 %.2f (single view)", epoch, top1, top5)

        if rank == 0 and ((epoch + 1) % args.ckpt_period == 0 or epoch + 1 == args.epochs):
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scaler": scaler.state_dict(), "epoch": epoch}
            torch.save(state, latest + ".part")
            os.replace(latest + ".part", latest)
            if (epoch + 1) % 20 == 0:
                torch.save(state["model"], os.path.join(args.work_dir, f"epoch_{epoch + 1}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
