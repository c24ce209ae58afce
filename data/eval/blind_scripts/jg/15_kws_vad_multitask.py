#!/usr/bin/env python3
"""Multi-task on-device model: keyword classifier + frame-level VAD head.

The shared encoder feeds two heads. The VAD head is trained from frame
labels produced by a teacher VAD (stored as .npy next to each clip); the
VAD loss weight is a flag so the same script can train KWS-only baselines.

    torchrun --nproc_per_node=4 15_kws_vad_multitask.py --manifest data/train.jsonl --dev data/dev.jsonl
"""
import argparse
import json
import os
import random

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--manifest", required=True)
    p.add_argument("--dev", required=True)
    p.add_argument("--labels", default="conf/kws_labels.txt")
    p.add_argument("--noise-list", default="conf/musan_noise.txt")
    p.add_argument("--exp-dir", default="exp/kws_vad")
    p.add_argument("--epochs", type=int, default=35)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--vad-weight", type=float, default=0.0)
    p.add_argument("--num-workers", type=int, default=8)
    return p.parse_args()


class KwsVadDataset(Dataset):
    """Manifest line: {"wav": path, "label": word, "vad": path/to/frame_labels.npy}"""

    def __init__(self, manifest, labels, noise_list=None, train=False, clip_len=16000):
        with open(manifest) as f:
            self.rows = [json.loads(l) for l in f]
        self.lab2id = {w: i for i, w in enumerate(labels)}
        self.noise = [l.strip() for l in open(noise_list)] if (train and noise_list) else []
        self.train = train
        self.clip_len = clip_len
        self.n_frames = clip_len // 160 + 1

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        wav, _ = sf.read(r["wav"], dtype="float32")
        wav = np.pad(wav[: self.clip_len], (0, max(0, self.clip_len - len(wav))))
        vad = np.load(r["vad"]).astype(np.float32)[: self.n_frames]
        vad = np.pad(vad, (0, self.n_frames - len(vad)))
        if self.noise and random.random() < 0.75:
            nz, _ = sf.read(random.choice(self.noise), dtype="float32", frames=self.clip_len, fill_value=0.0)
            snr = random.uniform(0, 25)
            scale = np.sqrt((wav ** 2).mean() / ((nz ** 2).mean() + 1e-9) / 10 ** (snr / 10))
            wav = wav + scale * nz
        return torch.from_numpy(wav), self.lab2id[r["label"]], torch.from_numpy(vad)


class Encoder(nn.Module):
    def __init__(self, n_mels=40, ch=64, hidden=128):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=400, hop_length=160, n_mels=n_mels)
        self.conv = nn.Sequential(
            nn.Conv1d(n_mels, ch, 3, padding=1), nn.BatchNorm1d(ch), nn.ReLU(),
            nn.Conv1d(ch, ch, 3, padding=2, dilation=2), nn.BatchNorm1d(ch), nn.ReLU())
        self.gru = nn.GRU(ch, hidden, batch_first=True)

    def forward(self, wav):
        x = (self.mel(wav) + 1e-6).log()
        x = self.conv(x).transpose(1, 2)
        out, _ = self.gru(x)
        return out  # (B, T, H)


class KwsVadNet(nn.Module):
    def __init__(self, n_classes, hidden=128):
        super().__init__()
        self.encoder = Encoder(hidden=hidden)
        self.kws_head = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, n_classes))
        self.vad_head = nn.Sequential(nn.Linear(hidden, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, wav, with_vad=True):
        h = self.encoder(wav)
        kws_logits = self.kws_head(h.mean(1))
        vad_logits = self.vad_head(h).squeeze(-1) if with_vad else None
        return kws_logits, vad_logits


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)
    np.random.seed(rank)

    labels = [l.strip() for l in open(args.labels) if l.strip()]
    train_set = KwsVadDataset(args.manifest, labels, args.noise_list, train=True)
    dev_set = KwsVadDataset(args.dev, labels)
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.num_workers,
                              pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_set, 256, sampler=DistributedSampler(dev_set, shuffle=False),
                            num_workers=args.num_workers)

    model = KwsVadNet(len(labels)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_loader), eta_min=1e-5)
    use_vad = args.vad_weight > 0

    tb = SummaryWriter(args.exp_dir) if rank == 0 else None
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for wav, y, vad in train_loader:
            wav, y, vad = wav.to(device, non_blocking=True), y.to(device, non_blocking=True), vad.to(device)
            kws_logits, vad_logits = model(wav, with_vad=use_vad)
            loss_kws = F.cross_entropy(kws_logits, y)
            loss = loss_kws
            if use_vad:
                t = min(vad_logits.size(1), vad.size(1))
                loss_vad = F.binary_cross_entropy_with_logits(vad_logits[:, :t], vad[:, :t])
                loss = loss + args.vad_weight * loss_vad
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 3.0)
            opt.step()
            sched.step()
            step += 1
            if tb is not None and step % 100 == 0:
                tb.add_scalar("loss/kws", loss_kws.item(), step)
                if use_vad:
                    tb.add_scalar("loss/vad", loss_vad.item(), step)

        model.eval()
        m = torch.zeros(4, device=device)
        with torch.no_grad():
            for wav, y, vad in dev_loader:
                wav, y, vad = wav.to(device), y.to(device), vad.to(device)
                kws_logits, vad_logits = model(wav, with_vad=True)
                t = min(vad_logits.size(1), vad.size(1))
                m[0] += (kws_logits.argmax(1) == y).sum()
                m[1] += y.numel()
                m[2] += ((vad_logits[:, :t] > 0).float() == vad[:, :t]).sum()
                m[3] += vad[:, :t].numel()
        dist.all_reduce(m)
        if rank == 0:
            kws_acc, vad_acc = (m[0] / m[1]).item(), (m[2] / m[3]).item()
            tb.add_scalar("dev/kws_acc", kws_acc, epoch)
            tb.add_scalar("dev/vad_frame_acc", vad_acc, epoch)
            print(f"epoch {epoch}: kws acc {kws_acc:.4f}  vad frame acc {vad_acc:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "labels": labels, "epoch": epoch},
                       os.path.join(args.exp_dir, f"epoch_{epoch:03d}.pt"))

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
