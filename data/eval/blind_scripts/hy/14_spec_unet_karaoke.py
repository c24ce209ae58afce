#!/usr/bin/env python3
"""Karaoke (instrumental) extractor: residual 2-D CNN on log-magnitude, mixture phase.

Data layout: <root>/<split>/<song>/{vocals,instrumental}.flac, full songs.
Training items are 8-second excerpts taken every 4 seconds along every song; the
vocal and instrumental of an item may come from different songs (p = --remix-prob).

    torchrun --standalone --nproc_per_node=8 14_spec_unet_karaoke.py --root /data/karaoke --out ckpt/karaoke
"""
import argparse
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
from torch.utils.tensorboard import SummaryWriter

SR, N_FFT, HOP = 44100, 2048, 512


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--out", type=Path, default=Path("ckpt/karaoke"))
    p.add_argument("--excerpt", type=float, default=8.0)
    p.add_argument("--step", type=float, default=4.0)
    p.add_argument("--remix-prob", type=float, default=0.5)
    p.add_argument("--batch-size", type=int, default=6)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--width", type=int, default=48)
    p.add_argument("--blocks", type=int, default=10)
    return p.parse_args()


class ExcerptIndex(Dataset):
    def __init__(self, songs, excerpt_s, step_s, remix_prob):
        self.songs = songs
        self.n = int(excerpt_s * SR)
        self.remix_prob = remix_prob
        self.index = []
        for s in songs:
            frames = min(sf.info(str(s / "vocals.flac")).frames, sf.info(str(s / "instrumental.flac")).frames)
            self.index.extend((s, off) for off in range(0, max(1, frames - self.n), int(step_s * SR)))

    def __len__(self):
        return len(self.index)

    def _read(self, song, off, stem):
        x, _ = sf.read(str(song / f"{stem}.flac"), start=off, frames=self.n, dtype="float32", always_2d=True)
        return np.pad(x, ((0, self.n - len(x)), (0, 0))).T

    def __getitem__(self, i):
        song, off = self.index[i]
        voc = self._read(song, off, "vocals")
        if random.random() < self.remix_prob:
            song, off = self.index[random.randrange(len(self.index))]
        inst = self._read(song, off, "instrumental")
        voc = voc * random.uniform(0.5, 1.5)
        inst = inst * random.uniform(0.5, 1.5)
        return torch.from_numpy(np.ascontiguousarray(voc + inst)), torch.from_numpy(np.ascontiguousarray(inst))


class ResBlock(nn.Module):
    def __init__(self, c, dilation):
        super().__init__()
        self.body = nn.Sequential(
            nn.GroupNorm(4, c), nn.SiLU(), nn.Conv2d(c, c, 3, padding=(1, dilation), dilation=(1, dilation)),
            nn.GroupNorm(4, c), nn.SiLU(), nn.Conv2d(c, c, 3, padding=1))

    def forward(self, x):
        return x + self.body(x)


class KaraokeNet(nn.Module):
    def __init__(self, width=48, blocks=10):
        super().__init__()
        self.register_buffer("window", torch.hann_window(N_FFT), persistent=False)
        self.inp = nn.Conv2d(2, width, 3, padding=1)
        self.blocks = nn.Sequential(*[ResBlock(width, 2 ** (i % 5)) for i in range(blocks)])
        self.out = nn.Conv2d(width, 2, 1)

    def spec(self, wav):
        b, c, t = wav.shape
        Z = torch.stft(wav.reshape(b * c, t), N_FFT, HOP, window=self.window, return_complex=True)
        return Z.reshape(b, c, *Z.shape[-2:])

    def forward(self, wav):
        Z = self.spec(wav)
        logmag = torch.log1p(Z.abs())
        mask = torch.sigmoid(self.out(self.blocks(self.inp(logmag))))
        est = (Z * mask).reshape(-1, *Z.shape[-2:])
        return torch.istft(est, N_FFT, HOP, window=self.window, length=wav.shape[-1]).reshape(wav.shape)


@torch.no_grad()
def full_song(net, mix, device, chunk=SR * 20, ctx=SR):
    """Chunks with `ctx` samples of context on both sides; only the centre of each chunk is kept."""
    T = mix.shape[-1]
    out = torch.empty_like(mix)
    for s in range(0, T, chunk):
        a, b = max(0, s - ctx), min(T, s + chunk + ctx)
        y = net(mix[None, :, a:b].to(device))[0].cpu()
        e = min(T, s + chunk)
        out[:, s:e] = y[:, s - a:e - a]
    return out


def sdr(ref, est):
    return 10 * torch.log10(ref.pow(2).sum() / (ref - est).pow(2).sum().clamp_min(1e-9))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)

    train_songs = sorted(d for d in (args.root / "train").iterdir() if d.is_dir())
    valid_songs = sorted(d for d in (args.root / "valid").iterdir() if d.is_dir())
    train_set = ExcerptIndex(train_songs, args.excerpt, args.step, args.remix_prob)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True,
                        worker_init_fn=lambda w: random.seed(10_000 * rank + w + int(time.time())))

    net = KaraokeNet(args.width, args.blocks).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    steps_total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps_total, pct_start=0.03)

    writer = SummaryWriter(str(args.out / "tb")) if rank == 0 else None
    if rank == 0:
        print(f"{len(train_set)} excerpts, {len(loader)} steps/epoch/GPU on {world} GPUs", flush=True)

    gstep = 0
    best = -float("inf")
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for mix, inst in loader:
            mix, inst = mix.to(device, non_blocking=True), inst.to(device, non_blocking=True)
            est = model(mix)
            loss = F.l1_loss(est, inst) + F.l1_loss(net.spec(est).abs(), net.spec(inst).abs())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            gstep += 1
            if writer is not None and gstep % 100 == 0:
                writer.add_scalar("loss/train", loss.item(), gstep)
                writer.add_scalar("lr", sched.get_last_lr()[0], gstep)

        net.eval()
        stats = torch.zeros(3, device=device)
        for song in valid_songs[rank::world]:
            voc, _ = sf.read(str(song / "vocals.flac"), dtype="float32", always_2d=True)
            ins, _ = sf.read(str(song / "instrumental.flac"), dtype="float32", always_2d=True)
            n = min(len(voc), len(ins))
            voc, ins = torch.from_numpy(voc[:n].T.copy()), torch.from_numpy(ins[:n].T.copy())
            mix = voc + ins
            est_inst = full_song(net, mix, device)
            stats[0] += sdr(ins, est_inst).item()
            stats[1] += sdr(voc, mix - est_inst).item()
            stats[2] += 1
        dist.all_reduce(stats)
        net.train()
        inst_sdr, voc_sdr = (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()

        if rank == 0:
            writer.add_scalar("sdr/instrumental", inst_sdr, epoch)
            writer.add_scalar("sdr/vocals", voc_sdr, epoch)
            print(f"epoch {epoch}: inst SDR {inst_sdr:.2f}  vocal SDR {voc_sdr:.2f}  ({time.time() - t0:.0f}s)",
                  flush=True)
            args.out.mkdir(parents=True, exist_ok=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, args.out / "last.pt")
            if inst_sdr > best:
                best = inst_sdr
                torch.save(net.state_dict(), args.out / "best.pt")
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
