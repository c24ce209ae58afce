#!/usr/bin/env python3
"""Train a waveform Demucs-style separator on MUSDB18-HQ with on-the-fly remixing.

Launch with torchrun, one process per GPU.
"""
import argparse
import json
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SOURCES = ["drums", "bass", "other", "vocals"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--musdb", type=Path, required=True, help="MUSDB18-HQ root (train/ and test/)")
    p.add_argument("--out", type=Path, default=Path("outputs/hdemucs"))
    p.add_argument("--epochs", type=int, default=360)
    p.add_argument("--batch-size", type=int, default=4, help="per GPU")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--segment", type=float, default=7.8)
    p.add_argument("--samples-per-epoch", type=int, default=12000)
    p.add_argument("--channels", type=int, default=48)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--valid-every", type=int, default=10)
    p.add_argument("--valid-overlap", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def list_tracks(root, subset):
    return sorted(d for d in (root / subset).iterdir() if d.is_dir())


class RemixDataset(Dataset):
    """Each item is a fresh mixture built from stems of random tracks."""

    def __init__(self, tracks, segment, samplerate=44100, length=12000, seed=0):
        self.tracks = tracks
        self.seg_len = int(segment * samplerate)
        self.length = length
        self.seed = seed
        self.epoch = 0
        self.frames = {t: sf.info(str(t / "mixture.wav")).frames for t in tracks}

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.length

    def _read(self, track, stem, start):
        wav, _ = sf.read(str(track / f"{stem}.wav"), start=start, frames=self.seg_len,
                         dtype="float32", always_2d=True)
        if wav.shape[0] < self.seg_len:
            wav = np.pad(wav, ((0, self.seg_len - wav.shape[0]), (0, 0)))
        return torch.from_numpy(wav.T)

    def __getitem__(self, index):
        rng = random.Random(self.seed * 1_000_003 + self.epoch * 100_000 + index)
        stems = []
        for stem in SOURCES:
            track = rng.choice(self.tracks)
            start = rng.randint(0, max(0, self.frames[track] - self.seg_len))
            wav = self._read(track, stem, start)
            wav = wav * rng.uniform(0.25, 1.25)
            if rng.random() < 0.5:
                wav = wav.flip(0)
            if rng.random() < 0.5:
                wav = -wav
            stems.append(wav)
        return torch.stack(stems)


def center_trim(x, ref):
    length = ref if isinstance(ref, int) else ref.shape[-1]
    delta = x.shape[-1] - length
    if delta > 0:
        x = x[..., delta // 2: x.shape[-1] - (delta - delta // 2)]
    return x


class DemucsLite(nn.Module):
    def __init__(self, sources, audio_channels=2, channels=48, depth=5, kernel=8, stride=4):
        super().__init__()
        self.sources = sources
        self.audio_channels = audio_channels
        self.depth, self.kernel, self.stride = depth, kernel, stride
        self.encoder = nn.ModuleList()
        self.decoder = nn.ModuleList()
        ch_in, ch = audio_channels, channels
        for i in range(depth):
            self.encoder.append(nn.Sequential(
                nn.Conv1d(ch_in, ch, kernel, stride), nn.GELU(),
                nn.Conv1d(ch, 2 * ch, 1), nn.GLU(1)))
            out = len(sources) * audio_channels if i == 0 else ch_in
            dec = [nn.Conv1d(ch, 2 * ch, 3, padding=1), nn.GLU(1), nn.ConvTranspose1d(ch, out, kernel, stride)]
            if i > 0:
                dec.append(nn.GELU())
            self.decoder.insert(0, nn.Sequential(*dec))
            ch_in, ch = ch, 2 * ch
        self.lstm = nn.LSTM(ch_in, ch_in, num_layers=2, bidirectional=True)
        self.lstm_proj = nn.Linear(2 * ch_in, ch_in)

    def valid_length(self, length):
        for _ in range(self.depth):
            length = max(1, math.ceil((length - self.kernel) / self.stride) + 1)
        for _ in range(self.depth):
            length = (length - 1) * self.stride + self.kernel
        return int(length)

    def forward(self, mix):
        length = mix.shape[-1]
        mono = mix.mean(dim=1, keepdim=True)
        mean, std = mono.mean(dim=-1, keepdim=True), mono.std(dim=-1, keepdim=True)
        x = (mix - mean) / (1e-5 + std)
        delta = self.valid_length(length) - length
        x = F.pad(x, (delta // 2, delta - delta // 2))
        skips = []
        for enc in self.encoder:
            x = enc(x)
            skips.append(x)
        x, _ = self.lstm(x.permute(2, 0, 1))
        x = self.lstm_proj(x).permute(1, 2, 0)
        for dec in self.decoder:
            x = dec(x + center_trim(skips.pop(-1), x))
        x = center_trim(x, length)
        x = x.view(x.size(0), len(self.sources), self.audio_channels, length)
        return x * std.unsqueeze(1) + mean.unsqueeze(1)


def nsdr(ref, est, eps=1e-8):
    num = ref.pow(2).sum(dim=(-2, -1))
    den = (ref - est).pow(2).sum(dim=(-2, -1))
    return 10 * torch.log10((num + eps) / (den + eps))


@torch.no_grad()
def separate(model, mix, seg_len, overlap, device, batch=8):
    """Overlap-add over a whole track. mix: (C, T) on CPU."""
    stride = int((1 - overlap) * seg_len)
    length = mix.shape[-1]
    out = torch.zeros(len(SOURCES), mix.shape[0], length)
    weight = torch.zeros(length)
    window = torch.cat([torch.arange(1, seg_len // 2 + 1), torch.arange(seg_len - seg_len // 2, 0, -1)]).float()
    window = window / window.max()
    offsets = list(range(0, length, stride))
    for i in range(0, len(offsets), batch):
        chunk_offsets = offsets[i:i + batch]
        chunks = []
        for off in chunk_offsets:
            c = mix[:, off:off + seg_len]
            chunks.append(F.pad(c, (0, seg_len - c.shape[-1])))
        est = model(torch.stack(chunks).to(device)).cpu()
        for off, e in zip(chunk_offsets, est):
            n = min(seg_len, length - off)
            out[..., off:off + n] += e[..., :n] * window[:n]
            weight[off:off + n] += window[:n]
    return out / weight.clamp_min(1e-8)


def validate(model, tracks, args, device, rank, world):
    net = model.module
    net.eval()
    seg_len = int(args.segment * 44100)
    scores = []
    for track in tracks[rank::world]:
        mix, _ = sf.read(str(track / "mixture.wav"), dtype="float32", always_2d=True)
        mix = torch.from_numpy(mix.T)
        refs = torch.stack([torch.from_numpy(sf.read(str(track / f"{s}.wav"), dtype="float32",
                                                     always_2d=True)[0].T) for s in SOURCES])
        est = separate(net, mix, seg_len, args.valid_overlap, device)
        scores.append(nsdr(refs, est))
    local = torch.stack(scores).to(device)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    net.train()
    return torch.cat(gathered).mean(dim=0)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_tracks = list_tracks(args.musdb, "train")
    valid_names = set(json.loads((args.musdb / "valid_tracks.json").read_text()))
    valid_tracks = [t for t in train_tracks if t.name in valid_names]
    train_tracks = [t for t in train_tracks if t.name not in valid_names]

    dataset = RemixDataset(train_tracks, args.segment, length=args.samples_per_epoch, seed=args.seed)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = DemucsLite(SOURCES, channels=args.channels).to(device)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=args.lr)

    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        print(f"world={world} tracks train={len(train_tracks)} valid={len(valid_tracks)}", flush=True)

    best = -float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        dataset.set_epoch(epoch)
        t0, total, count = time.time(), torch.zeros(1, device=device), 0
        for stems in loader:
            stems = stems.to(device, non_blocking=True)
            mix = stems.sum(dim=1)
            est = model(mix)
            loss = F.l1_loss(est, stems)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            total += loss.detach()
            count += 1
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch} loss {total.item() / (count * world):.4f} ({time.time() - t0:.0f}s)", flush=True)

        if (epoch + 1) % args.valid_every == 0:
            sdr = validate(model, valid_tracks, args, device, rank, world)
            if rank == 0:
                msg = " ".join(f"{s}={v:.2f}" for s, v in zip(SOURCES, sdr.tolist()))
                print(f"valid epoch {epoch}: nSDR mean={sdr.mean():.2f} {msg}", flush=True)
                state = {"epoch": epoch, "model": model.module.state_dict(), "optim": optim.state_dict(),
                         "args": vars(args)}
                torch.save(state, args.out / "last.th")
                if sdr.mean() > best:
                    best = sdr.mean().item()
                    torch.save(model.module.state_dict(), args.out / "best.th")
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
