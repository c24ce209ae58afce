#!/usr/bin/env python
# Keyword Transformer (KWT-1) on Google Speech Commands v2, full 35-word task.
#
#   torchrun --nproc_per_node=8 03_kwt_speechcommands35.py --root /datasets/SpeechCommands/speech_commands_v0.02
#
import argparse
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    parser = argparse.ArgumentParser("KWT")
    parser.add_argument("--root", type=str, required=True)
    parser.add_argument("--save-dir", type=str, default="checkpoints/kwt1")
    parser.add_argument("--epochs", type=int, default=140)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--wd", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--mixup", type=float, default=0.0)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--amp", action="store_true")
    return parser.parse_args()


class SpeechCommands35(Dataset):
    def __init__(self, root, subset, augment=False):
        root = Path(root)
        files = [p for p in root.glob("*/*.wav") if p.parent.name != "_background_noise_"]
        self.classes = list({p.parent.name for p in files})
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}

        def _load(name):
            return {root / line.strip() for line in open(root / name)}

        val, test = _load("validation_list.txt"), _load("testing_list.txt")
        if subset == "validation":
            files = [f for f in files if f in val]
        elif subset == "testing":
            files = [f for f in files if f in test]
        else:
            files = [f for f in files if f not in val and f not in test]
        self.files = sorted(files)
        self.augment = augment
        self.noise = [torchaudio.load(str(p))[0][0] for p in sorted((root / "_background_noise_").glob("*.wav"))]
        self.melspec = torchaudio.transforms.MelSpectrogram(
            sample_rate=16000, n_fft=480, win_length=480, hop_length=160, n_mels=40)
        self.time_mask = torchaudio.transforms.TimeMasking(25)
        self.freq_mask = torchaudio.transforms.FrequencyMasking(7)

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        path = self.files[i]
        wav, _ = torchaudio.load(str(path))
        wav = wav[0]
        if wav.numel() < 16000:
            wav = F.pad(wav, (0, 16000 - wav.numel()))
        if self.augment:
            shift = random.randint(-1600, 1600)
            wav = torch.roll(wav, shift)
            if random.random() < 0.8:
                n = random.choice(self.noise)
                s = random.randint(0, n.numel() - 16000)
                wav = wav + random.uniform(0, 0.1) * n[s:s + 16000]
        mel = torch.log(self.melspec(wav) + 1e-6)  # (40, 98)
        if self.augment:
            mel = self.freq_mask(self.time_mask(mel.unsqueeze(0))).squeeze(0)
        return mel, self.class_to_idx[path.parent.name]


class PreNorm(nn.Module):
    def __init__(self, dim, fn):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.norm(x))


class KWT(nn.Module):
    def __init__(self, n_classes, n_frames=98, n_mels=40, dim=64, depth=12, heads=1, mlp_dim=256, dropout=0.0):
        super().__init__()
        self.patch = nn.Linear(n_mels, dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, n_frames + 1, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, mlp_dim, dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.head = PreNorm(dim, nn.Linear(dim, n_classes))

    def forward(self, mel):
        x = self.patch(mel.transpose(1, 2))
        x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], dim=1) + self.pos
        x = self.encoder(x)
        return self.head(x[:, 0])


def cosine_with_warmup(opt, warmup, total):
    def f(ep):
        if ep < warmup:
            return (ep + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (ep - warmup) / max(1, total - warmup)))
    return torch.optim.lr_scheduler.LambdaLR(opt, f)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    for mel, y in loader:
        mel, y = mel.to(device), y.to(device)
        logits = model(mel)
        stats[0] += F.cross_entropy(logits, y, reduction="sum")
        stats[1] += (logits.argmax(1) == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = dist.get_rank()
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")

    seed = 42 + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(42)

    train_ds = SpeechCommands35(args.root, "training", augment=True)
    val_ds = SpeechCommands35(args.root, "validation")
    test_ds = SpeechCommands35(args.root, "testing")
    n_classes = len(train_ds.classes)

    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, 256, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=args.workers)
    test_loader = DataLoader(test_ds, 256, sampler=DistributedSampler(test_ds, shuffle=False),
                             num_workers=args.workers)

    model = KWT(n_classes, dim=args.dim, depth=args.depth, heads=args.heads).to(device)
    model = DDP(model, device_ids=[local_rank])
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "pos" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "pos" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    sched = cosine_with_warmup(opt, args.warmup, args.epochs)
    scaler = GradScaler(enabled=args.amp)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"{n_classes} classes, {len(train_ds)} train / {len(val_ds)} val / {len(test_ds)} test, "
              f"{sum(p.numel() for p in model.parameters()) / 1e3:.1f}k params")

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (mel, y) in enumerate(train_loader):
            mel, y = mel.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast(enabled=args.amp):
                logits = model(mel)
                loss = F.cross_entropy(logits, y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f}", flush=True)
        sched.step()

        val_loss, val_acc = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"== epoch {epoch} val_loss {val_loss:.4f} val_acc {val_acc:.4f} "
                  f"lr {sched.get_last_lr()[0]:.2e} time {time.time() - tic:.0f}s")
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save({"model": model.module.state_dict(), "classes": train_ds.classes,
                            "epoch": epoch, "val_acc": val_acc},
                           os.path.join(args.save_dir, "best.pth"))

    test_loss, test_acc = evaluate(model, test_loader, device)
    if rank == 0:
        print(f"test acc (last epoch weights) {test_acc:.4f}, best val {best_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
