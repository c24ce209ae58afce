"""Spleeter-style 2-stem (vocals / accompaniment) U-Net, PyTorch port, multi-GPU via mp.spawn.

    python 06_unet_spawn_syncbn.py --data /data/musdb18hq --gpus 4 --out ckpt/unet2stems
"""
import argparse
import os
import random
import socket
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_FFT, HOP, F_BINS = 4096, 1024, 1024
STEMS = ("vocals", "accompaniment")
ACC = ("drums", "bass", "other")


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Down(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 5, stride=2, padding=2)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return F.leaky_relu(self.bn(self.conv(x)), 0.2)


class Up(nn.Module):
    def __init__(self, cin, cout, dropout):
        super().__init__()
        self.deconv = nn.ConvTranspose2d(cin, cout, 5, stride=2, padding=2, output_padding=1)
        self.bn = nn.BatchNorm2d(cout)
        self.drop = nn.Dropout2d(0.5) if dropout else nn.Identity()

    def forward(self, x):
        return self.drop(self.bn(F.relu(self.deconv(x))))


class UNet(nn.Module):
    def __init__(self, in_ch=2, widths=(16, 32, 64, 128, 256, 512)):
        super().__init__()
        chans = (in_ch,) + widths
        self.down = nn.ModuleList(Down(chans[i], chans[i + 1]) for i in range(len(widths)))
        ups = []
        for i in reversed(range(len(widths))):
            cin = widths[i] if i == len(widths) - 1 else 2 * widths[i]
            cout = widths[i - 1] if i > 0 else 1
            ups.append(Up(cin, cout, dropout=i >= len(widths) - 3))
        self.up = nn.ModuleList(ups)
        self.out = nn.Conv2d(1, in_ch, 4, padding="same")

    def forward(self, mag):
        skips, x = [], mag
        for d in self.down:
            x = d(x)
            skips.append(x)
        skips.pop()
        for u in self.up:
            x = u(x)
            if skips:
                x = torch.cat([x, skips.pop()], dim=1)
        return torch.sigmoid(self.out(x))


class Separator(nn.Module):
    def __init__(self):
        super().__init__()
        self.nets = nn.ModuleDict({s: UNet() for s in STEMS})
        self.register_buffer("window", torch.hann_window(N_FFT), persistent=False)

    def spec(self, wav):
        b, c, t = wav.shape
        z = torch.stft(wav.reshape(b * c, t), N_FFT, HOP, window=self.window, return_complex=True)
        return z.reshape(b, c, z.shape[-2], z.shape[-1])

    def forward(self, wav):
        z = self.spec(wav)
        mag = z.abs()[:, :, :F_BINS]
        frames = mag.shape[-1]
        pad = (-frames) % 64
        mag = F.pad(mag, (0, pad))
        masks = {s: net(mag)[..., :frames] for s, net in self.nets.items()}
        total = sum(m ** 2 for m in masks.values()) + 1e-10
        out = {}
        for s, m in masks.items():
            m = F.pad(m ** 2 / total, (0, 0, 0, z.shape[-2] - F_BINS))
            est = (z * m).reshape(-1, z.shape[-2], frames)
            out[s] = torch.istft(est, N_FFT, HOP, window=self.window, length=wav.shape[-1]).reshape(wav.shape)
        return torch.stack([out[s] for s in STEMS], dim=1)


class TwoStemRemix(Dataset):
    def __init__(self, tracks, seconds, items, sr=44100):
        self.tracks, self.items, self.n = tracks, items, int(seconds * sr)
        self.frames = {t: sf.info(str(t / "mixture.wav")).frames for t in tracks}
        self.epoch = 0

    def __len__(self):
        return self.items

    def read(self, track, stem, rng):
        start = int(rng.integers(0, max(1, self.frames[track] - self.n)))
        x, _ = sf.read(str(track / f"{stem}.wav"), start=start, frames=self.n, dtype="float32", always_2d=True)
        return np.pad(x, ((0, self.n - len(x)), (0, 0))).T

    def __getitem__(self, i):
        rng = np.random.default_rng([self.epoch, i])
        voc = self.read(self.tracks[rng.integers(len(self.tracks))], "vocals", rng) * rng.uniform(0.5, 1.2)
        acc = sum(self.read(self.tracks[rng.integers(len(self.tracks))], s, rng) * rng.uniform(0.5, 1.2) for s in ACC)
        return torch.from_numpy(np.stack([voc, acc]).astype(np.float32))


@torch.no_grad()
def sharded_separation(net, mix, chunk, hop, rank, world, dev):
    """Every rank does every world-th chunk of the track; the summed buffers give the full estimate."""
    T = mix.shape[-1]
    win = torch.hann_window(chunk, periodic=False, device=dev).clamp_min(1e-3)
    starts = list(range(0, max(1, T - chunk + hop), hop))
    out = torch.zeros(len(STEMS), mix.shape[0], T, device=dev)
    wsum = torch.zeros(T, device=dev)
    for s in starts[rank::world]:
        seg = mix[:, s:s + chunk]
        n = seg.shape[-1]
        seg = F.pad(seg, (0, chunk - n)).unsqueeze(0).to(dev)
        out[..., s:s + n] += net(seg)[0, ..., :n] * win[:n]
        wsum[s:s + n] += win[:n]
    dist.all_reduce(out)
    dist.all_reduce(wsum)
    return out / wsum.clamp_min(1e-6)


def validate(net, tracks, rank, world, dev, chunk_s=20.0, sr=44100):
    net.eval()
    chunk = int(chunk_s * sr)
    scores = []
    for t in tracks:
        mix = torch.from_numpy(sf.read(str(t / "mixture.wav"), dtype="float32", always_2d=True)[0].T)
        voc = sf.read(str(t / "vocals.wav"), dtype="float32", always_2d=True)[0].T
        acc = sum(sf.read(str(t / f"{s}.wav"), dtype="float32", always_2d=True)[0].T for s in ACC)
        ref = torch.from_numpy(np.stack([voc, acc])).to(dev)
        est = sharded_separation(net, mix, chunk, chunk * 3 // 4, rank, world, dev)
        sdr = 10 * torch.log10(ref.pow(2).sum((1, 2)) / (ref - est).pow(2).sum((1, 2)).clamp_min(1e-8))
        scores.append(sdr)
    net.train()
    return torch.stack(scores).mean(0)


def worker(rank, world, args, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    dev = torch.device("cuda", rank)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    root = Path(args.data)
    train_tracks = sorted(p for p in (root / "train").iterdir() if p.is_dir())
    valid_names = set(args.valid.split(",")) if args.valid else set()
    valid_tracks = [p for p in train_tracks if p.name in valid_names]
    train_tracks = [p for p in train_tracks if p.name not in valid_names]

    ds = TwoStemRemix(train_tracks, args.seconds, args.items)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    dl = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=args.workers, drop_last=True,
                    pin_memory=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(Separator()).to(dev)
    model = DDP(net, device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    out = Path(args.out)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ds.epoch = epoch
        running = torch.zeros(2, device=dev)
        for stems in dl:
            stems = stems.to(dev, non_blocking=True)
            est = model(stems.sum(1))
            loss = F.l1_loss(est, stems)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += torch.stack([loss.detach(), torch.ones_like(loss)])
        dist.all_reduce(running)
        msg = f"epoch {epoch} l1 {running[0].item() / running[1].item():.5f}"
        if valid_tracks and (epoch + 1) % args.eval_every == 0:
            sdr = validate(net, valid_tracks, rank, world, dev)
            msg += " | SDR " + " ".join(f"{s}={v:.2f}" for s, v in zip(STEMS, sdr.tolist()))
        if rank == 0:
            print(msg, flush=True)
            out.mkdir(parents=True, exist_ok=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch}, out / "last.pt")
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="ckpt/unet2stems")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--valid", default="")
    ap.add_argument("--seconds", type=float, default=11.88)
    ap.add_argument("--items", type=int, default=8000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    mp.spawn(worker, args=(args.gpus, args, free_port()), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
