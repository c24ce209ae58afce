#!/usr/bin/env python3
"""Binary wake-word detector ("hey nova") with false-reject / false-alarm tracking.

* positives: ~12k recorded "hey nova" utterances (+ TTS), negatives: speech,
  music and household noise.  Positive clips are mixed with room noise on the fly.
* model: 2-layer causal conv + GRU over 40-d log-mel, one sigmoid output per frame.
* dev metrics: false-reject rate on held-out speakers, false alarms per hour
  on 20 h of continuous negative audio run in streaming mode, split across ranks.

    torchrun --nproc_per_node=8 11_wakeword_far_binary.py --cfg conf/hey_nova.json
"""
import argparse
import json
import os
import random
from glob import glob

import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = dict(pos_train="lists/pos_train.txt", neg_train="lists/neg_train.txt", pos_dev="lists/pos_dev.txt",
                far_dir="/data/far_20h", noise_dir="/data/rir_noise/noise", out="exp/hey_nova",
                clip_s=2.0, epochs=25, bs=192, lr=2e-3, threshold=0.7, smooth=20, refractory_s=2.0,
                pos_weight=4.0, workers=8)


def read_list(path):
    with open(path) as f:
        return [l.strip() for l in f if l.strip()]


class WakeWordClips(Dataset):
    def __init__(self, pos, neg, noise_dir, clip_s, train):
        self.items = [(p, 1.0) for p in pos] + [(n, 0.0) for n in neg]
        self.noises = sorted(glob(os.path.join(noise_dir, "*.wav"))) if train else []
        self.n = int(clip_s * 16000)
        self.train = train

    def __len__(self):
        return len(self.items)

    def _crop(self, wav, random_pos):
        if wav.numel() >= self.n:
            o = random.randint(0, wav.numel() - self.n) if random_pos else 0
            return wav[o:o + self.n]
        lead = random.randint(0, self.n - wav.numel()) if random_pos else 0
        return F.pad(wav, (lead, self.n - wav.numel() - lead))

    def __getitem__(self, i):
        path, y = self.items[i]
        wav, _ = sf.read(path, dtype="float32", always_2d=True)
        wav = self._crop(torch.from_numpy(wav[:, 0]), self.train)
        if self.train and self.noises and random.random() < 0.9:
            noise, _ = sf.read(random.choice(self.noises), dtype="float32", always_2d=True)
            noise = self._crop(torch.from_numpy(noise[:, 0]), True)
            snr = random.uniform(-5, 20)
            g = wav.pow(2).mean().add(1e-9).sqrt() / noise.pow(2).mean().add(1e-9).sqrt() / (10 ** (snr / 20))
            wav = wav + g * noise
        return wav, torch.tensor(y)


class Detector(nn.Module):
    def __init__(self, n_mels=40, ch=64, hidden=96):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=400, hop_length=160, n_mels=n_mels)
        self.conv1 = nn.Conv1d(n_mels, ch, 5)
        self.conv2 = nn.Conv1d(ch, ch, 5, dilation=2)
        self.bn1, self.bn2 = nn.BatchNorm1d(ch), nn.BatchNorm1d(ch)
        self.gru = nn.GRU(ch, hidden, batch_first=True)
        self.out = nn.Linear(hidden, 1)

    def forward(self, wav):
        x = (self.mel(wav) + 1e-6).log()
        x = F.relu(self.bn1(self.conv1(F.pad(x, (4, 0)))))
        x = F.relu(self.bn2(self.conv2(F.pad(x, (8, 0)))))
        x, _ = self.gru(x.transpose(1, 2))
        return self.out(x).squeeze(-1)  # (B, T) frame logits


def count_false_alarms(scores, threshold, smooth, refractory_frames):
    s = F.avg_pool1d(scores[None, None], smooth, 1, padding=smooth // 2, count_include_pad=False)[0, 0]
    hits, t = 0, 0
    above = (s >= threshold).nonzero().flatten().tolist()
    for f in above:
        if f >= t:
            hits += 1
            t = f + refractory_frames
    return hits


@torch.no_grad()
def far_eval(model, files, device, cfg, chunk_s=60):
    """Streams this rank's share of the long negative recordings."""
    model.eval()
    false_alarms, seconds = 0, 0.0
    for path in files:
        audio, sr = sf.read(path, dtype="float32", always_2d=True)
        audio = torch.from_numpy(audio[:, 0])
        seconds += audio.numel() / sr
        scores = []
        for s in range(0, audio.numel(), chunk_s * sr):
            scores.append(torch.sigmoid(model(audio[s:s + chunk_s * sr].to(device)[None]))[0])
        scores = torch.cat(scores)
        false_alarms += count_false_alarms(scores, cfg["threshold"], cfg["smooth"], int(cfg["refractory_s"] * 100))
    return false_alarms, seconds


@torch.no_grad()
def frr_eval(model, loader, device, threshold):
    model.eval()
    miss = torch.zeros(2, device=device)
    for wav, y in loader:
        p = torch.sigmoid(model(wav.to(device))).amax(1)
        miss[0] += (p < threshold).sum()
        miss[1] += p.numel()
    dist.all_reduce(miss)
    return (miss[0] / miss[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    cfg = dict(DEFAULTS)
    a = ap.parse_args()
    if a.cfg:
        cfg.update(json.load(open(a.cfg)))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)

    train_set = WakeWordClips(read_list(cfg["pos_train"]), read_list(cfg["neg_train"]), cfg["noise_dir"],
                              cfg["clip_s"], train=True)
    dev_pos = WakeWordClips(read_list(cfg["pos_dev"]), [], cfg["noise_dir"], cfg["clip_s"], train=False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, cfg["bs"], sampler=sampler, num_workers=cfg["workers"],
                              pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_pos, 256, sampler=DistributedSampler(dev_pos, shuffle=False),
                            num_workers=cfg["workers"])
    far_files = sorted(glob(os.path.join(cfg["far_dir"], "*.flac")))[rank::world]

    model = DDP(Detector().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg["lr"], total_steps=cfg["epochs"] * len(train_loader))
    pos_weight = torch.tensor(cfg["pos_weight"], device=device)

    os.makedirs(cfg["out"], exist_ok=True)
    best_frr = 1.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        for wav, y in train_loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(wav)
            # max-pool over time: a positive clip only has to fire somewhere
            clip_logit = logits.amax(1)
            loss = F.binary_cross_entropy_with_logits(clip_logit, y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()

        frr = frr_eval(model, dev_loader, device, cfg["threshold"])
        fa, secs = far_eval(model.module, far_files, device, cfg)
        totals = torch.tensor([fa, secs], dtype=torch.float64)
        dist.all_reduce(totals)
        fa_per_hour = totals[0].item() / (totals[1].item() / 3600.0)

        if rank == 0:
            print(f"epoch {epoch}: FRR {frr * 100:.2f}%  FA/h {fa_per_hour:.3f}  loss {loss.item():.4f}", flush=True)
            ckpt = {"model": model.module.state_dict(), "cfg": cfg, "epoch": epoch, "frr": frr, "fa_h": fa_per_hour}
            torch.save(ckpt, os.path.join(cfg["out"], f"epoch{epoch:02d}.pt"))
            if fa_per_hour <= 0.5 and frr < best_frr:
                best_frr = frr
                torch.save(ckpt, os.path.join(cfg["out"], "best.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
