"""
Action recognition on UCF101 / HMDB51 style data with R(2+1)D-18 (Kinetics-400 pretrained).
Frames are pre-extracted to <root>/frames/<video_id>/img_00001.jpg ...
Annotation lists: "<video_id> <num_frames> <label>" per line.

Usage:
    python -m torch.distributed.launch --nproc_per_node=8 04_video_r2plus1d.py \
        --root /data/ucf101 --train-list lists/trainlist01.txt --val-list lists/testlist01.txt
"""
import argparse
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.video import R2Plus1D_18_Weights, r2plus1d_18

logger = logging.getLogger("video")

MEAN = torch.tensor([0.43216, 0.394666, 0.37645]).view(3, 1, 1, 1)
STD = torch.tensor([0.22803, 0.22145, 0.216989]).view(3, 1, 1, 1)


class FrameClipDataset(Dataset):
    def __init__(self, root, list_file, clip_len=16, stride=2, size=112, train=True):
        self.root = root
        self.clip_len = clip_len
        self.stride = stride
        self.size = size
        self.train = train
        self.items = []
        with open(list_file) as f:
            for line in f:
                vid, n, label = line.split()
                self.items.append((vid, int(n), int(label)))

    def __len__(self):
        return len(self.items)

    def _indices(self, n):
        span = self.clip_len * self.stride
        if n <= span:
            idx = np.arange(0, span, self.stride) % max(n, 1)
        elif self.train:
            start = random.randint(0, n - span)
            idx = np.arange(start, start + span, self.stride)
        else:
            start = (n - span) // 2
            idx = np.arange(start, start + span, self.stride)
        return idx + 1  # frames are 1-indexed

    def __getitem__(self, i):
        vid, n, label = self.items[i]
        frames = []
        for k in self._indices(n):
            img = Image.open(os.path.join(self.root, "frames", vid, f"img_{k:05d}.jpg")).convert("RGB")
            img = img.resize((171, 128))
            frames.append(torch.from_numpy(np.asarray(img)))
        clip = torch.stack(frames).permute(3, 0, 1, 2).float() / 255.0  # C T H W
        _, _, h, w = clip.shape
        if self.train:
            y, x = random.randint(0, h - self.size), random.randint(0, w - self.size)
            clip = clip[:, :, y:y + self.size, x:x + self.size]
            if random.random() < 0.5:
                clip = clip.flip(-1)
        else:
            y, x = (h - self.size) // 2, (w - self.size) // 2
            clip = clip[:, :, y:y + self.size, x:x + self.size]
        clip = (clip - MEAN) / STD
        return clip, label


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--train-list", required=True)
    parser.add_argument("--val-list", required=True)
    parser.add_argument("--num-classes", type=int, default=101)
    parser.add_argument("--clip-len", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=16, help="clips per GPU")
    parser.add_argument("--lr", type=float, default=0.01, help="lr for 64 clips")
    parser.add_argument("--epochs", type=int, default=45)
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--output-dir", default="work_dirs/r2plus1d_ucf101")
    parser.add_argument("--local_rank", type=int, default=-1)
    return parser.parse_args()


def train_one_epoch(model, loader, criterion, optimizer, scaler, device, epoch, args):
    model.train()
    meter = torch.zeros(3, device=device)  # loss sum, correct, samples
    end = time.time()
    for i, (clips, labels) in enumerate(loader):
        clips = clips.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(clips)
            loss = criterion(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

        meter[0] += loss.detach() * labels.size(0)
        meter[1] += (logits.argmax(1) == labels).sum()
        meter[2] += labels.size(0)
        if i % 20 == 0 and dist.get_rank() == 0:
            logger.info("epoch %d [%d/%d] loss %.4f %.2fs/it", epoch, i, len(loader),
                        loss.item(), (time.time() - end) / (i + 1))
    dist.all_reduce(meter)
    return (meter[0] / meter[2]).item(), (meter[1] / meter[2]).item()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    meter = torch.zeros(2, device=device)
    for clips, labels in loader:
        clips = clips.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(clips)
        meter[0] += (logits.argmax(1) == labels).sum()
        meter[1] += labels.size(0)
    dist.all_reduce(meter)
    return (meter[0] / meter[1]).item()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    random.seed(42 + rank)
    np.random.seed(42 + rank)
    torch.manual_seed(42)

    train_set = FrameClipDataset(args.root, args.train_list, args.clip_len, train=True)
    val_set = FrameClipDataset(args.root, args.val_list, args.clip_len, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_set = Subset(val_set, list(range(rank, len(val_set), world_size)))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, shuffle=False,
                            num_workers=args.workers, pin_memory=True)

    model = r2plus1d_18(weights=R2Plus1D_18_Weights.KINETICS400_V1)
    model.fc = nn.Linear(model.fc.in_features, args.num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)

    lr = args.lr * args.batch_size * world_size / 64
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[20, 35], gamma=0.1)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss()

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        tr_loss, tr_acc = train_one_epoch(model, train_loader, criterion, optimizer, scaler,
                                          device, epoch, args)
        scheduler.step()
        val_acc = validate(model.module, val_loader, device)
        logger.info("epoch %d train_loss %.4f train_acc %.4f val_acc %.4f", epoch, tr_loss, tr_acc, val_acc)
        if rank == 0:
            os.makedirs(args.output_dir, exist_ok=True)
            ckpt = {"epoch": epoch, "state_dict": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()}
            torch.save(ckpt, os.path.join(args.output_dir, "latest.pth"))
            if val_acc > best:
                best = val_acc
                torch.save(ckpt, os.path.join(args.output_dir, "best.pth"))
        dist.barrier()

    logger.info("best val acc %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
