"""Sound event detection (DCASE task 4 style): CRNN trained on weakly labelled clips,
plus a frame-level loss on the batches that come from the strongly labelled subset.

    torchrun --nproc_per_node=4 train_sed.py --config conf/crnn.json
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
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["Alarm_bell_ringing", "Blender", "Cat", "Dishes", "Dog", "Electric_shaver_toothbrush",
           "Frying", "Running_water", "Speech", "Vacuum_cleaner"]
FPS = 16000 / 256 / 4  # output frames per second (16 kHz, hop 256, pooled 4x in time)

CONFIG = {
    "weak_tsv": "meta/train/weak.tsv",
    "strong_tsv": "meta/train/synthetic.tsv",
    "audio_dir": "audio/train",
    "val_tsv": "meta/validation/weak.tsv",
    "val_audio_dir": "audio/validation",
    "batch_size": 24,
    "epochs": 100,
    "lr": 1e-3,
    "frame_loss_weight": 1.0,
    "out_dir": "exp/crnn",
}


class SEDDataset(Dataset):
    """Each item: log-mel (T, 128), clip target (C,), frame target (T', C) or None."""

    def __init__(self, tsv, audio_dir, strong=False, clip_sec=10.0):
        self.audio_dir, self.strong, self.clip_sec = audio_dir, strong, clip_sec
        self.items = {}
        with open(tsv) as f:
            next(f)
            for line in f:
                parts = line.rstrip("\n").split("\t")
                entry = self.items.setdefault(parts[0], [])
                if strong:
                    entry.append((float(parts[1]), float(parts[2]), parts[3]))
                else:
                    entry.extend(parts[1].split(","))
        self.files = sorted(self.items)
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=2048, hop_length=256, n_mels=128)

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        name = self.files[i]
        wav, sr = sf.read(os.path.join(self.audio_dir, name), dtype="float32")
        if wav.ndim > 1:
            wav = wav.mean(1)
        n = int(self.clip_sec * sr)
        wav = np.pad(wav[:n], (0, max(0, n - len(wav))))
        feats = torch.log(self.mel(torch.from_numpy(wav)) + 1e-8).T
        clip = torch.zeros(len(CLASSES))
        n_frames = int(self.clip_sec * FPS)
        frames = torch.zeros(n_frames, len(CLASSES))
        if self.strong:
            for onset, offset, label in self.items[name]:
                c = CLASSES.index(label)
                clip[c] = 1
                frames[int(onset * FPS):int(offset * FPS) + 1, c] = 1
        else:
            for label in self.items[name]:
                clip[CLASSES.index(label)] = 1
        return feats, clip, frames, torch.tensor(self.strong)


class CRNN(nn.Module):
    def __init__(self, n_classes=len(CLASSES), n_mels=128):
        super().__init__()
        chans = [1, 16, 32, 64, 128, 128]
        pools = [(2, 2), (2, 2), (1, 2), (1, 2), (1, 2)]
        layers = []
        for cin, cout, pool in zip(chans[:-1], chans[1:], pools):
            layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                       nn.AvgPool2d(pool), nn.Dropout(0.3)]
        self.cnn = nn.Sequential(*layers)
        self.rnn = nn.GRU(128 * (n_mels // 32), 128, num_layers=2, batch_first=True, bidirectional=True)
        self.clip_head = nn.Linear(256, n_classes)
        self.att = nn.Linear(256, n_classes)
        self.frame_head = nn.Linear(256, n_classes)

    def forward(self, x, return_frames=False):
        x = self.cnn(x.unsqueeze(1))                       # B, C, T/4, F/32
        b, c, t, f = x.shape
        x, _ = self.rnn(x.permute(0, 2, 1, 3).reshape(b, t, c * f))
        att = torch.softmax(self.att(x), dim=1)
        clip = (torch.sigmoid(self.clip_head(x)) * att).sum(1)
        if return_frames:
            return clip, torch.sigmoid(self.frame_head(x))
        return clip


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=None)
    p.add_argument("--seed", type=int, default=42)
    a = p.parse_args()
    cfg = dict(CONFIG)
    if a.config:
        with open(a.config) as f:
            cfg.update(json.load(f))
    cfg["seed"] = a.seed
    return cfg


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    tp = torch.zeros(len(CLASSES), device=device)
    fp = torch.zeros_like(tp)
    fn = torch.zeros_like(tp)
    for feats, clip, _, _ in loader:
        pred = (model.module(feats.to(device)) > 0.5).float()
        clip = clip.to(device)
        tp += (pred * clip).sum(0)
        fp += (pred * (1 - clip)).sum(0)
        fn += ((1 - pred) * clip).sum(0)
    for t in (tp, fp, fn):
        dist.all_reduce(t)
    f1 = 2 * tp / (2 * tp + fp + fn).clamp(min=1)
    return f1.mean().item()


def main():
    cfg = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])

    weak = SEDDataset(cfg["weak_tsv"], cfg["audio_dir"], strong=False)
    strong = SEDDataset(cfg["strong_tsv"], cfg["audio_dir"], strong=True)
    train_set = torch.utils.data.ConcatDataset([weak, strong])
    val_set = SEDDataset(cfg["val_tsv"], cfg["val_audio_dir"], strong=False)
    val_set = Subset(val_set, range(rank, len(val_set), world))

    sampler = DistributedSampler(train_set, shuffle=True, seed=cfg["seed"])
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=sampler, num_workers=6,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=cfg["batch_size"], num_workers=6)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(CRNN()).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, cfg["epochs"])

    best = 0.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(3, device=device)
        for feats, clip_t, frame_t, is_strong in train_loader:
            feats, clip_t = feats.to(device, non_blocking=True), clip_t.to(device, non_blocking=True)
            if is_strong.any():
                clip_p, frame_p = model(feats, return_frames=True)
                m = is_strong.to(device)
                frame_t = frame_t.to(device)
                t = min(frame_p.size(1), frame_t.size(1))
                frame_loss = F.binary_cross_entropy(frame_p[m, :t], frame_t[m, :t])
            else:
                clip_p = model(feats)
                frame_loss = torch.zeros((), device=device)
            clip_loss = F.binary_cross_entropy(clip_p, clip_t)
            loss = clip_loss + cfg["frame_loss_weight"] * frame_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            running += torch.stack([clip_loss.detach(), frame_loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(running)
        f1 = validate(model, val_loader, device)
        if rank == 0:
            n = running[2].item()
            print(f"epoch {epoch}: clip {running[0].item() / n:.4f} frame {running[1].item() / n:.4f} "
                  f"val macro-F1 {f1:.4f}", flush=True)
            os.makedirs(cfg["out_dir"], exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(cfg["out_dir"], "last.pt"))
            if f1 > best:
                best = f1
                torch.save({"model": model.module.state_dict(), "epoch": epoch},
                           os.path.join(cfg["out_dir"], "best.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
