#!/usr/bin/env python3
"""DS-CNN keyword spotting on Speech Commands v2 (12-class task) with DDP.

Reports top-1 accuracy on the official validation list and false alarms per
hour on a folder of long background recordings (TV, cafe, office) cut into
non-overlapping 1 s windows.

    torchrun --nproc_per_node=4 01_dscnn_far_ddp.py \
        --data-root /data/speech_commands_v0.02 --far-root /data/kws_negatives
"""
import argparse
import glob
import logging
import os
import random
import time

import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

KEYWORDS = ["yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go"]
LABELS = ["_silence_", "_unknown_"] + KEYWORDS
SR = 16000

log = logging.getLogger("dscnn")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", required=True)
    p.add_argument("--far-root", required=True, help="long negative recordings for FA/hr")
    p.add_argument("--out-dir", default="runs/dscnn")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--threshold", type=float, default=0.85)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def _read_list(root, name):
    with open(os.path.join(root, name)) as f:
        return {ln.strip() for ln in f if ln.strip()}


class SpeechCommands(Dataset):
    def __init__(self, root, split, unknown_frac=0.1, silence_frac=0.1, seed=0):
        val = _read_list(root, "validation_list.txt")
        test = _read_list(root, "testing_list.txt")
        known, unknown = [], []
        for path in sorted(glob.glob(os.path.join(root, "*", "*.wav"))):
            rel = os.path.relpath(path, root)
            word = rel.split(os.sep)[0]
            if word == "_background_noise_":
                continue
            where = "val" if rel in val else "test" if rel in test else "train"
            if where != split:
                continue
            if word in KEYWORDS:
                known.append((path, LABELS.index(word)))
            else:
                unknown.append((path, 1))
        random.Random(seed).shuffle(unknown)
        items = known + unknown[: int(len(known) * unknown_frac)]
        items += [(None, 0)] * int(len(known) * silence_frac)
        self.items = items
        self.train = split == "train"
        self.noises = [torch.from_numpy(sf.read(p, dtype="float32")[0]) for p in
                       sorted(glob.glob(os.path.join(root, "_background_noise_", "*.wav")))]

    def __len__(self):
        return len(self.items)

    def _noise_clip(self):
        noise = random.choice(self.noises)
        start = random.randint(0, noise.numel() - SR)
        return noise[start:start + SR]

    def __getitem__(self, idx):
        path, label = self.items[idx]
        if path is None:
            return self._noise_clip() * random.uniform(0.0, 0.5), label
        wav, _ = sf.read(path, dtype="float32")
        wav = torch.from_numpy(wav)
        wav = F.pad(wav, (0, max(0, SR - wav.numel())))[:SR]
        if self.train:
            shift = random.randint(-1600, 1600)
            wav = torch.roll(wav, shift)
            if shift > 0:
                wav[:shift] = 0
            elif shift < 0:
                wav[shift:] = 0
            if random.random() < 0.8:
                wav = wav + self._noise_clip() * random.uniform(0.0, 0.1)
        return wav, label


class BackgroundWindows(Dataset):
    """Non-overlapping 1 s windows over long negative recordings."""

    def __init__(self, root):
        self.index = []
        self.total_seconds = 0.0
        for path in sorted(glob.glob(os.path.join(root, "**", "*.wav"), recursive=True)):
            info = sf.info(path)
            assert info.samplerate == SR, path
            self.total_seconds += info.frames / SR
            for start in range(0, info.frames - SR + 1, SR):
                self.index.append((path, start))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, idx):
        path, start = self.index[idx]
        wav, _ = sf.read(path, start=start, frames=SR, dtype="float32")
        return torch.from_numpy(wav)


class LogMel(nn.Module):
    def __init__(self, n_mels=40):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(
            SR, n_fft=480, win_length=480, hop_length=160, n_mels=n_mels)

    def forward(self, wav):
        return torch.log(self.mel(wav) + 1e-6).transpose(1, 2)  # (B, T, F)


class DSBlock(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.dw = nn.Conv2d(ch, ch, 3, padding=1, groups=ch, bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.pw = nn.Conv2d(ch, ch, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(ch)

    def forward(self, x):
        x = F.relu(self.bn1(self.dw(x)))
        return F.relu(self.bn2(self.pw(x)))


class DSCNN(nn.Module):
    def __init__(self, n_classes, ch=172, n_blocks=5):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, ch, (10, 4), stride=(2, 2), padding=(5, 1), bias=False),
            nn.BatchNorm2d(ch), nn.ReLU(inplace=True))
        self.blocks = nn.Sequential(*[DSBlock(ch) for _ in range(n_blocks)])
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(ch, n_classes)

    def forward(self, feats):
        x = self.blocks(self.stem(feats.unsqueeze(1)))
        return self.fc(self.drop(x.mean(dim=(2, 3))))


@torch.no_grad()
def evaluate(model, frontend, val_loader, far_loader, far_hours, device, threshold):
    model.eval()
    correct, total = 0, 0
    for wav, label in val_loader:
        wav = wav.to(device, non_blocking=True)
        label = label.to(device, non_blocking=True)
        logits = model(frontend(wav))
        correct += (logits.argmax(-1) == label).sum().item()
        total += label.numel()
    false_alarms = 0
    for wav in far_loader:
        probs = model(frontend(wav.to(device, non_blocking=True))).softmax(-1)
        kw_prob = probs[:, 2:].max(-1).values
        false_alarms += (kw_prob >= threshold).sum().item()
    model.train()
    return correct / max(total, 1), false_alarms / far_hours


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)
    random.seed(args.seed + rank)

    train_set = SpeechCommands(args.data_root, "train", seed=args.seed)
    val_set = SpeechCommands(args.data_root, "val", seed=args.seed)
    far_set = BackgroundWindows(args.far_root)
    far_hours = far_set.total_seconds / 3600.0
    log.info("train %d  val %d  negatives %.1f h  world %d", len(train_set), len(val_set),
             far_hours, world)

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=256,
                            sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, pin_memory=True)
    far_loader = DataLoader(far_set, batch_size=256,
                            sampler=DistributedSampler(far_set, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    frontend = LogMel().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(DSCNN(len(LABELS))).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=args.lr, total_steps=args.epochs * len(train_loader), pct_start=0.1)

    os.makedirs(args.out_dir, exist_ok=True)
    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for wav, label in train_loader:
            wav = wav.to(device, non_blocking=True)
            label = label.to(device, non_blocking=True)
            with torch.no_grad():
                feats = frontend(wav)
            loss = F.cross_entropy(model(feats), label, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            running[0] += loss.detach() * label.numel()
            running[1] += label.numel()
        dist.all_reduce(running)

        acc, far = evaluate(model, frontend, val_loader, far_loader, far_hours, device,
                            args.threshold)
        if rank == 0:
            log.info("epoch %3d  loss %.4f  val_acc %.4f  fa/hr %.2f  lr %.2e  %.0fs",
                     epoch, (running[0] / running[1]).item(), acc, far,
                     sched.get_last_lr()[0], time.time() - t0)
            state = {"epoch": epoch, "model": model.module.state_dict(),
                     "labels": LABELS, "val_acc": acc, "fa_per_hour": far}
            torch.save(state, os.path.join(args.out_dir, "last.pt"))
            if acc > best_acc:
                best_acc = acc
                torch.save(state, os.path.join(args.out_dir, "best.pt"))

    if rank == 0:
        log.info("done, best val acc %.4f", best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
