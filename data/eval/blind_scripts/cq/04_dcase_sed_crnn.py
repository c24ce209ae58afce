"""DCASE Task 4 style sound event detection: CRNN trained on weak + synthetic strong labels.

    torchrun --nproc_per_node=4 04_dcase_sed_crnn.py --config conf/crnn.yaml
"""
import argparse
import os
import random

import numpy as np
import pandas as pd
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchaudio.transforms import AmplitudeToDB, MelSpectrogram

CLASSES = ["Alarm_bell_ringing", "Blender", "Cat", "Dishes", "Dog", "Electric_shaver_toothbrush",
           "Frying", "Running_water", "Speech", "Vacuum_cleaner"]
CLS2IDX = {c: i for i, c in enumerate(CLASSES)}

DEFAULTS = dict(sr=16000, seconds=10.0, n_fft=2048, hop=256, n_mels=128, pool_time=4,
                batch_size=24, lr=1e-3, epochs=200, workers=6, out="exp/crnn",
                weak_tsv="metadata/train/weak.tsv", weak_dir="audio/train/weak_16k",
                strong_tsv="metadata/train/synthetic21_train/soundscapes.tsv",
                strong_dir="audio/train/synthetic21_train/soundscapes_16k",
                val_tsv="metadata/validation/validation.tsv", val_dir="audio/validation/validation_16k")


class SEDSet(Dataset):
    """Returns wav, weak (clip) target, strong (frame) target and whether the strong target is real."""

    def __init__(self, tsv, audio_dir, cfg, strong):
        df = pd.read_csv(tsv, sep="\t")
        self.dir, self.strong = audio_dir, strong
        self.n = int(cfg["sr"] * cfg["seconds"])
        self.n_frames = (self.n // cfg["hop"] + 1) // cfg["pool_time"]
        self.frame_sec = cfg["seconds"] / self.n_frames
        if strong:
            df = df.dropna(subset=["event_label"])
            self.files = sorted(df["filename"].unique())
            self.events = {f: g[["onset", "offset", "event_label"]].values for f, g in df.groupby("filename")}
        else:
            self.files = df["filename"].tolist()
            self.weak = dict(zip(df["filename"], df["event_labels"]))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        f = self.files[i]
        wav, _ = sf.read(os.path.join(self.dir, f), dtype="float32")
        if wav.ndim > 1:
            wav = wav[:, 0]
        wav = np.pad(wav, (0, max(0, self.n - len(wav))))[: self.n]
        frames = np.zeros((self.n_frames, len(CLASSES)), np.float32)
        clip = np.zeros(len(CLASSES), np.float32)
        if self.strong:
            for on, off, lab in self.events.get(f, []):
                c = CLS2IDX[lab]
                frames[int(on / self.frame_sec): int(np.ceil(off / self.frame_sec)), c] = 1.0
                clip[c] = 1.0
        else:
            for lab in self.weak[f].split(","):
                clip[CLS2IDX[lab]] = 1.0
        return torch.from_numpy(wav), torch.from_numpy(clip), torch.from_numpy(frames), float(self.strong)


class CRNN(nn.Module):
    def __init__(self, n_mels, n_classes, pool_time=4):
        super().__init__()
        chans = [1, 16, 32, 64, 128, 128, 128, 128]
        pools = [(2, 2), (2, 2), (1, 2), (1, 2), (1, 2), (1, 2), (1, 2)]
        layers = []
        for i, p in enumerate(pools):
            layers += [nn.Conv2d(chans[i], chans[i + 1], 3, padding=1), nn.BatchNorm2d(chans[i + 1]),
                       nn.ReLU(inplace=True), nn.AvgPool2d(p), nn.Dropout(0.5)]
        self.cnn = nn.Sequential(*layers)
        self.rnn = nn.GRU(128, 128, num_layers=2, batch_first=True, bidirectional=True, dropout=0.0)
        self.frame_head = nn.Linear(256, n_classes)
        self.att = nn.Linear(256, 1)
        self.clip_head = nn.Linear(256, n_classes)

    def forward(self, x):                        # x: (B, 1, T, F)
        h = self.cnn(x)                          # (B, C, T/4, 1)
        h = h.squeeze(-1).transpose(1, 2)        # (B, T', C)
        h, _ = self.rnn(h)
        strong = torch.sigmoid(self.frame_head(h))     # (B, T', classes)
        att = torch.softmax(self.att(h), dim=1)        # (B, T', 1)
        weak = torch.sigmoid(self.clip_head((att * h).sum(1)))
        return strong, weak


class LogMel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.mel = MelSpectrogram(cfg["sr"], n_fft=cfg["n_fft"], hop_length=cfg["hop"], n_mels=cfg["n_mels"],
                                  f_min=0, f_max=8000, window_fn=torch.hamming_window)
        self.db = AmplitudeToDB(stype="amplitude", top_db=80.0)

    @torch.no_grad()
    def forward(self, wav):
        x = self.db(self.mel(wav))
        x = (x - x.mean(dim=(1, 2), keepdim=True)) / (x.std(dim=(1, 2), keepdim=True) + 1e-5)
        return x.transpose(1, 2).unsqueeze(1)


def frame_shift(x, frames, max_shift=30, pool=4):
    shift = random.randint(-max_shift, max_shift) // pool * pool
    return torch.roll(x, shift, dims=2), torch.roll(frames, shift // pool, dims=1)


@torch.no_grad()
def validate(model, frontend, loader, device, thr=0.5):
    model.eval()
    counts = torch.zeros(3, len(CLASSES), device=device)   # tp, fp, fn (frame-based)
    clip_counts = torch.zeros(3, len(CLASSES), device=device)
    for wav, clip, frames, _ in loader:
        strong, weak = model(frontend(wav.to(device)))
        frames, clip = frames.to(device), clip.to(device)
        pred = (strong > thr).float()
        counts[0] += (pred * frames).sum((0, 1))
        counts[1] += (pred * (1 - frames)).sum((0, 1))
        counts[2] += ((1 - pred) * frames).sum((0, 1))
        cp = (weak > thr).float()
        clip_counts[0] += (cp * clip).sum(0)
        clip_counts[1] += (cp * (1 - clip)).sum(0)
        clip_counts[2] += ((1 - cp) * clip).sum(0)
    dist.all_reduce(counts)
    dist.all_reduce(clip_counts)

    def f1(c):
        return (2 * c[0] / (2 * c[0] + c[1] + c[2]).clamp(min=1)).mean().item()

    return f1(counts), f1(clip_counts)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    parser.add_argument("--root", default="/data/dcase2021/dataset")
    args = parser.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(1)

    r = lambda p: os.path.join(args.root, p)
    weak = SEDSet(r(cfg["weak_tsv"]), r(cfg["weak_dir"]), cfg, strong=False)
    synth = SEDSet(r(cfg["strong_tsv"]), r(cfg["strong_dir"]), cfg, strong=True)
    valid = SEDSet(r(cfg["val_tsv"]), r(cfg["val_dir"]), cfg, strong=True)
    weak_sampler = DistributedSampler(weak, shuffle=True, drop_last=True)
    synth_sampler = DistributedSampler(synth, shuffle=True, drop_last=True)
    weak_loader = DataLoader(weak, batch_size=cfg["batch_size"], sampler=weak_sampler,
                             num_workers=cfg["workers"] // 2, pin_memory=True, drop_last=True)
    synth_loader = DataLoader(synth, batch_size=cfg["batch_size"], sampler=synth_sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    # strided shard without padding, so validation clips are counted once
    val_loader = DataLoader(valid, batch_size=32, sampler=list(range(rank, len(valid), world)),
                            num_workers=cfg["workers"])
    steps_per_epoch = 2 * min(len(weak_loader), len(synth_loader))

    model = CRNN(cfg["n_mels"], len(CLASSES), cfg["pool_time"])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = DDP(model, device_ids=[local_rank])
    frontend = LogMel(cfg).cuda()
    lr = cfg["lr"] * world
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999))
    warmup = 50 * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, np.exp(-5.0 * (1 - min(s, warmup) / warmup) ** 2)))
    bce = nn.BCELoss()

    writer = SummaryWriter(os.path.join(cfg["out"], "tb")) if rank == 0 else None
    best = -1.0
    for epoch in range(cfg["epochs"]):
        weak_sampler.set_epoch(epoch)
        synth_sampler.set_epoch(epoch)
        model.train()
        # alternate weakly labelled and synthetic strongly labelled batches
        batches = (b for pair in zip(weak_loader, synth_loader) for b in pair)
        for it, (wav, clip, frames, is_strong) in enumerate(batches):
            wav, clip, frames = wav.to(device), clip.to(device), frames.to(device)
            x = frontend(wav)
            x, frames = frame_shift(x, frames, pool=cfg["pool_time"])
            strong_pred, weak_pred = model(x)
            loss = bce(weak_pred, clip)
            if bool(is_strong[0]):
                loss = loss + bce(strong_pred, frames)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if writer is not None and it % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), epoch * steps_per_epoch + it)

        frame_f1, clip_f1 = validate(model.module, frontend, val_loader, device)
        if rank == 0:
            writer.add_scalar("val/frame_f1", frame_f1, epoch)
            writer.add_scalar("val/clip_f1", clip_f1, epoch)
            print(f"epoch {epoch}: frame F1 {frame_f1:.4f} clip F1 {clip_f1:.4f}", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "cfg": cfg}
            os.makedirs(cfg["out"], exist_ok=True)
            torch.save(state, os.path.join(cfg["out"], "last.ckpt"))
            if frame_f1 > best:
                best = frame_f1
                torch.save(state, os.path.join(cfg["out"], "best.ckpt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
