#!/usr/bin/env python3
"""
Environmental sound classification (ESC-50 layout: audio/*.wav + meta/esc50.csv)
with a log-mel CNN. Fold 5 is held out for validation.

Multi-GPU training with DistributedDataParallel:

    torchrun --nproc_per_node=4 12_audio_event_cnn.py --root /data/ESC-50 --epochs 200
"""
import argparse
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm


def get_args():
    parser = argparse.ArgumentParser(description="ESC-50 CNN, DDP")
    parser.add_argument("--root", required=True)
    parser.add_argument("--val-fold", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--sample-rate", type=int, default=32000)
    parser.add_argument("--n-mels", type=int, default=128)
    parser.add_argument("--mixup-alpha", type=float, default=0.2)
    parser.add_argument("--save-dir", default="checkpoints/esc50")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def init_distributed(args):
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    return torch.device("cuda", args.local_rank)


def cleanup():
    dist.destroy_process_group()


def is_main_process():
    return dist.get_rank() == 0


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class ESC50(Dataset):
    def __init__(self, root, folds, sample_rate, train):
        meta = pd.read_csv(os.path.join(root, "meta", "esc50.csv"))
        meta = meta[meta["fold"].isin(folds)].reset_index(drop=True)
        self.files = [os.path.join(root, "audio", f) for f in meta["filename"]]
        self.labels = meta["target"].tolist()
        self.sample_rate = sample_rate
        self.train = train
        self.num_samples = sample_rate * 5

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        wav, sr = torchaudio.load(self.files[idx])
        wav = wav.mean(0)
        if sr != self.sample_rate:
            wav = torchaudio.functional.resample(wav, sr, self.sample_rate)
        if wav.numel() < self.num_samples:
            wav = F.pad(wav, (0, self.num_samples - wav.numel()))
        wav = wav[: self.num_samples]
        if self.train:
            shift = random.randint(0, self.sample_rate // 2)
            wav = torch.roll(wav, shift)
            wav = wav * random.uniform(0.7, 1.3)
        return wav, self.labels[idx]


class ConvBlock(nn.Module):
    def __init__(self, c_in, c_out):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return F.avg_pool2d(x, 2)


class LogMelCNN(nn.Module):
    def __init__(self, sample_rate, n_mels, num_classes=50):
        super().__init__()
        self.melspec = torchaudio.transforms.MelSpectrogram(sample_rate, n_fft=1024, hop_length=320,
                                                            n_mels=n_mels, f_min=50, f_max=14000)
        self.to_db = torchaudio.transforms.AmplitudeToDB(top_db=80)
        self.bn0 = nn.BatchNorm2d(1)
        self.blocks = nn.Sequential(ConvBlock(1, 64), ConvBlock(64, 128), ConvBlock(128, 256),
                                    ConvBlock(256, 512))
        self.dropout = nn.Dropout(0.3)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, wav):
        x = self.to_db(self.melspec(wav)).unsqueeze(1)
        x = self.blocks(self.bn0(x))
        x = x.mean(dim=3).amax(dim=2)
        return self.fc(self.dropout(x))


def mixup(x, y, alpha, num_classes=50):
    y = F.one_hot(y, num_classes).float()
    if alpha <= 0:
        return x, y
    lam = np.random.beta(alpha, alpha)
    perm = torch.randperm(x.size(0), device=x.device)
    return lam * x + (1 - lam) * x[perm], lam * y + (1 - lam) * y[perm]


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    hits = torch.zeros(2, device=device)
    for wav, y in loader:
        wav, y = wav.to(device), y.to(device)
        hits[0] += (model(wav).argmax(1) == y).sum()
        hits[1] += y.numel()
    dist.all_reduce(hits)
    return (hits[0] / hits[1]).item()


def main():
    args = get_args()
    device = init_distributed(args)
    world_size = dist.get_world_size()
    seed_everything(args.seed + dist.get_rank())

    train_folds = [f for f in range(1, 6) if f != args.val_fold]
    train_ds = ESC50(args.root, train_folds, args.sample_rate, train=True)
    val_ds = ESC50(args.root, [args.val_fold], args.sample_rate, train=False)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True, persistent_workers=True)
    # 400 clips per fold -> splits evenly for 1/2/4/8 GPUs
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=val_sampler, num_workers=4)

    model = LogMelCNN(args.sample_rate, args.n_mels)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[device.index])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world_size ** 0.5, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=50)

    if is_main_process():
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"world size {world_size}, {len(train_ds)} train clips, {len(val_ds)} val clips")

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(1, device=device)
        for i, (wav, y) in enumerate(tqdm(train_loader, disable=not is_main_process(), leave=False)):
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            wav, y_soft = mixup(wav, y, args.mixup_alpha)
            logits = model(wav)
            loss = torch.sum(-y_soft * F.log_softmax(logits, dim=1), dim=1).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step(epoch + i / len(train_loader))
            running += loss.detach()
        dist.all_reduce(running)
        train_loss = running.item() / (len(train_loader) * world_size)

        val_acc = validate(model, val_loader, device)
        if is_main_process():
            print(f"epoch {epoch:3d} | loss {train_loss:.4f} | val acc {val_acc:.4f} | {time.time() - t0:.0f}s",
                  flush=True)
            if val_acc > best:
                best = val_acc
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "val_acc": val_acc},
                           os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    if is_main_process():
        print(f"best val acc {best:.4f}")
    cleanup()


if __name__ == "__main__":
    main()
