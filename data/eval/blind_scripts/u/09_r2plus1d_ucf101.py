#!/usr/bin/env python3
# R(2+1)D-18 fine-tuning on UCF-101 (split 1) from Kinetics-400 weights.
# multi-gpu:
#   python -m torch.distributed.launch --use_env --nproc_per_node=4 09_r2plus1d_ucf101.py \
#       --root /data/UCF-101 --split_dir /data/ucfTrainTestlist --resume auto
import argparse
import glob
import os
import random
import time

import decord
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import Dataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.models.video import r2plus1d_18, R2Plus1D_18_Weights

decord.bridge.set_bridge('torch')

MEAN = torch.tensor([0.43216, 0.394666, 0.37645]).view(3, 1, 1, 1)
STD = torch.tensor([0.22803, 0.22145, 0.216989]).view(3, 1, 1, 1)


class UCF101Clips(Dataset):
    def __init__(self, root, split_file, classind, clip_len=16, stride=2, train=True, size=112):
        with open(classind) as f:
            self.cls = {l.split()[1]: int(l.split()[0]) - 1 for l in f if l.strip()}
        with open(split_file) as f:
            self.videos = [l.split()[0] for l in f if l.strip()]
        self.root, self.clip_len, self.stride, self.train, self.size = root, clip_len, stride, train, size

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, i):
        rel = self.videos[i]
        label = self.cls[rel.split('/')[0]]
        vr = decord.VideoReader(os.path.join(self.root, rel), width=171, height=128)
        n = len(vr)
        span = self.clip_len * self.stride
        if self.train:
            start = random.randint(0, max(n - span, 0))
        else:
            start = max((n - span) // 2, 0)
        idx = np.clip(np.arange(start, start + span, self.stride), 0, n - 1)
        frames = vr.get_batch(idx).permute(3, 0, 1, 2).float() / 255.  # C T H W
        h, w = frames.shape[-2:]
        if self.train:
            y, x = random.randint(0, h - self.size), random.randint(0, w - self.size)
            if random.random() < 0.5:
                frames = frames.flip(-1)
        else:
            y, x = (h - self.size) // 2, (w - self.size) // 2
        frames = frames[..., y:y + self.size, x:x + self.size]
        return (frames - MEAN) / STD, label


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument('--root', default='/data/UCF-101')
    p.add_argument('--split_dir', default='/data/ucfTrainTestlist')
    p.add_argument('--split', type=int, default=1)
    p.add_argument('--clip_len', type=int, default=16)
    p.add_argument('--batch_size', type=int, default=16)
    p.add_argument('--epochs', type=int, default=30)
    p.add_argument('--lr', type=float, default=0.01)
    p.add_argument('--workers', type=int, default=10)
    p.add_argument('--out', default='work/r2p1d_ucf101')
    p.add_argument('--resume', default='', help="path or 'auto'")
    p.add_argument('--amp', action='store_true')
    return p.parse_args()


def reduce_mean(t):
    t = t.clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def main():
    args = get_args()
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank = dist.get_rank()
    world = dist.get_world_size()
    dev = torch.device('cuda', local_rank)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    classind = os.path.join(args.split_dir, 'classInd.txt')
    train_ds = UCF101Clips(args.root, os.path.join(args.split_dir, f'trainlist0{args.split}.txt'), classind,
                           clip_len=args.clip_len, train=True)
    test_list = os.path.join(args.split_dir, f'testlist0{args.split}.txt')
    val_ds = UCF101Clips(args.root, test_list, classind, clip_len=args.clip_len, train=False)
    train_sampler = DistributedSampler(train_ds)
    # every test video exactly once: strided split, no DistributedSampler padding
    val_part = Subset(val_ds, list(range(rank, len(val_ds), world)))
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_part, args.batch_size, shuffle=False, num_workers=args.workers, pin_memory=True)

    model = r2plus1d_18(weights=R2Plus1D_18_Weights.KINETICS400_V1)
    model.fc = nn.Linear(model.fc.in_features, 101)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])

    lr = args.lr * world * args.batch_size / 64
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    criterion = nn.CrossEntropyLoss()

    start_epoch, best_acc = 0, 0.
    resume = args.resume
    if resume == 'auto':
        cands = sorted(glob.glob(os.path.join(args.out, 'ckpt_ep*.pth')))
        resume = cands[-1] if cands else ''
    if resume:
        ckpt = torch.load(resume)
        model.module.load_state_dict(ckpt['model'])
        optimizer.load_state_dict(ckpt['optimizer'])
        scheduler.load_state_dict(ckpt['scheduler'])
        scaler.load_state_dict(ckpt['scaler'])
        start_epoch, best_acc = ckpt['epoch'] + 1, ckpt['best_acc']
        if rank == 0:
            print(f'=> resumed {resume}, epoch {start_epoch}, best {best_acc:.2f}')

    tb = SummaryWriter(os.path.join(args.out, 'runs')) if rank == 0 else None
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (clips, labels) in enumerate(train_dl):
            clips, labels = clips.to(dev, non_blocking=True), labels.to(dev, non_blocking=True)
            with torch.cuda.amp.autocast(enabled=args.amp):
                loss = criterion(model(clips), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if it % 20 == 0:
                l = reduce_mean(loss.detach())
                if rank == 0:
                    print(f'[{epoch}][{it}/{len(train_dl)}] loss {l.item():.4f} lr {scheduler.get_last_lr()[0]:.5f}')
                    tb.add_scalar('train/loss', l.item(), epoch * len(train_dl) + it)
        scheduler.step()

        # clip accuracy on the centre clip of each test video
        model.eval()
        correct = torch.zeros(2, device=dev)
        with torch.no_grad():
            for clips, labels in val_dl:
                clips, labels = clips.to(dev, non_blocking=True), labels.to(dev, non_blocking=True)
                with torch.cuda.amp.autocast(enabled=args.amp):
                    out = model.module(clips)
                correct[0] += (out.argmax(1) == labels).sum()
                correct[1] += labels.numel()
        dist.all_reduce(correct)
        acc = 100. * (correct[0] / correct[1]).item()
        best_acc = max(best_acc, acc)
        if rank == 0:
            print(f'epoch {epoch}: val clip acc {acc:.2f} (best {best_acc:.2f}) [{time.time() - t0:.0f}s]')
            tb.add_scalar('val/clip_acc', acc, epoch)
            torch.save({'model': model.module.state_dict(), 'optimizer': optimizer.state_dict(),
                        'scheduler': scheduler.state_dict(), 'scaler': scaler.state_dict(),
                        'epoch': epoch, 'best_acc': best_acc},
                       os.path.join(args.out, f'ckpt_ep{epoch:03d}.pth'))
        dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
