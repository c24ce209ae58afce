"""Open-Unmix (UMX) vocals model, multi-GPU.

The training set is cut into fixed, non-overlapping excerpts of every track (the full
songs are several minutes long and we want every second of them seen once per epoch);
half of the time the accompaniment of an excerpt is swapped for that of another excerpt.

    torchrun --nproc_per_node=4 08_openunmix_ddp.py --root /data/musdb18hq --target vocals
"""
import argparse
import json
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

ALL = ["vocals", "drums", "bass", "other"]


class OpenUnmix(nn.Module):
    def __init__(self, nb_bins=2049, nb_channels=2, hidden=512, nb_layers=3, max_bin=1487):
        super().__init__()
        self.nb_bins, self.max_bin, self.hidden = nb_bins, max_bin, hidden
        self.fc1 = nn.Linear(max_bin * nb_channels, hidden, bias=False)
        self.bn1 = nn.BatchNorm1d(hidden)
        self.lstm = nn.LSTM(hidden, hidden // 2, num_layers=nb_layers, bidirectional=True, dropout=0.4)
        self.fc2 = nn.Linear(hidden * 2, hidden, bias=False)
        self.bn2 = nn.BatchNorm1d(hidden)
        self.fc3 = nn.Linear(hidden, nb_bins * nb_channels, bias=False)
        self.bn3 = nn.BatchNorm1d(nb_bins * nb_channels)
        self.input_mean = nn.Parameter(torch.zeros(max_bin))
        self.input_scale = nn.Parameter(torch.ones(max_bin))
        self.output_scale = nn.Parameter(torch.ones(nb_bins))
        self.output_mean = nn.Parameter(torch.ones(nb_bins))

    def forward(self, spec):
        # spec: (frames, batch, channels, bins) magnitude
        x = spec
        mix = x.detach().clone()
        nb_frames, nb_samples, nb_channels, _ = x.shape
        x = x[..., :self.max_bin]
        x = (x + self.input_mean) * self.input_scale
        x = self.fc1(x.reshape(-1, nb_channels * self.max_bin))
        x = torch.tanh(self.bn1(x)).reshape(nb_frames, nb_samples, self.hidden)
        lstm_out, _ = self.lstm(x)
        x = torch.cat([x, lstm_out], -1)
        x = F.relu(self.bn2(self.fc2(x.reshape(-1, x.shape[-1]))))
        x = self.bn3(self.fc3(x)).reshape(nb_frames, nb_samples, nb_channels, self.nb_bins)
        x = x * self.output_scale + self.output_mean
        return F.relu(x) * mix


class STFT(nn.Module):
    def __init__(self, n_fft=4096, hop=1024):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)

    def forward(self, wav):  # (B, C, T) -> complex (B, C, F, N)
        b, c, t = wav.shape
        z = torch.stft(wav.reshape(b * c, t), self.n_fft, self.hop, window=self.window, center=True, return_complex=True)
        return z.reshape(b, c, z.shape[-2], z.shape[-1])

    def inverse(self, z, length):
        b, c, f, n = z.shape
        return torch.istft(z.reshape(b * c, f, n), self.n_fft, self.hop, window=self.window, length=length).reshape(b, c, length)


class ExcerptDataset(Dataset):
    def __init__(self, root, tracks, target, seconds, sr=44100, swap_prob=0.5):
        self.root, self.target, self.swap_prob = Path(root), target, swap_prob
        self.n = int(seconds * sr)
        self.items = []
        for t in tracks:
            frames = sf.info(str(self.root / t / "mixture.wav")).frames
            self.items += [(t, off) for off in range(0, frames - self.n, self.n)]

    def __len__(self):
        return len(self.items)

    def _read(self, track, off, stem):
        x, _ = sf.read(str(self.root / track / f"{stem}.wav"), start=off, frames=self.n, dtype="float32", always_2d=True)
        return x.T

    def __getitem__(self, i):
        track, off = self.items[i]
        tgt = self._read(track, off, self.target) * random.uniform(0.25, 1.25)
        if random.random() < self.swap_prob:
            track, off = random.choice(self.items)
        acc = sum(self._read(track, off, s) for s in ALL if s != self.target) * random.uniform(0.25, 1.25)
        return torch.from_numpy((tgt + acc).astype(np.float32)), torch.from_numpy(tgt.astype(np.float32))


@torch.no_grad()
def track_sdr(model, stft, root, track, target, device, chunk_s=30.0, sr=44100):
    mix, _ = sf.read(str(Path(root) / track / "mixture.wav"), dtype="float32", always_2d=True)
    ref, _ = sf.read(str(Path(root) / track / f"{target}.wav"), dtype="float32", always_2d=True)
    mix = torch.from_numpy(mix.T).to(device)
    ref = torch.from_numpy(ref.T).to(device)
    chunk, ctx = int(chunk_s * sr), 4 * stft.hop
    est = torch.zeros_like(mix)
    for s in range(0, mix.shape[-1], chunk):
        a, b = max(0, s - ctx), min(mix.shape[-1], s + chunk + ctx)
        z = stft(mix[None, :, a:b])
        mag = model(z.abs().permute(3, 0, 1, 2)).permute(1, 2, 3, 0)
        y = stft.inverse(torch.polar(mag, z.angle()), b - a)[0]
        est[:, s:min(s + chunk, mix.shape[-1])] = y[:, s - a:s - a + min(chunk, mix.shape[-1] - s)]
    return 10 * torch.log10(ref.pow(2).sum() / (ref - est).pow(2).sum().clamp_min(1e-9))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--target", default="vocals", choices=ALL)
    ap.add_argument("--splits", default="splits/musdb_umx.json")
    ap.add_argument("--out", default="umx_out")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=1000)
    ap.add_argument("--patience", type=int, default=140)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    splits = json.load(open(args.splits))
    train_ds = ExcerptDataset(args.root, splits["train"], args.target, args.seconds)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)

    stft = STFT().to(device)
    unmix = nn.SyncBatchNorm.convert_sync_batchnorm(OpenUnmix()).to(device)
    model = DDP(unmix, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.3, patience=80, cooldown=10)

    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    best, bad_epochs = -float("inf"), 0
    for epoch in range(args.epochs):
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for mix, tgt in train_loader:
            mix, tgt = mix.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            X, Y = stft(mix).abs(), stft(tgt).abs()
            Y_hat = model(X.permute(3, 0, 1, 2))
            loss = F.mse_loss(Y_hat, Y.permute(3, 0, 1, 2))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach() * mix.shape[0], torch.tensor(float(mix.shape[0]), device=device)])
        dist.all_reduce(tot)

        unmix.eval()
        acc = torch.zeros(2, device=device)
        for track in splits["valid"][rank::world]:
            acc[0] += track_sdr(unmix, stft, args.root, track, args.target, device)
            acc[1] += 1
        dist.all_reduce(acc)
        unmix.train()
        valid_sdr = (acc[0] / acc[1]).item()
        sched.step(-valid_sdr)

        if valid_sdr > best:
            best, bad_epochs = valid_sdr, 0
        else:
            bad_epochs += 1
        if rank == 0:
            print(f"epoch {epoch} train_mse {(tot[0] / tot[1]).item():.5f} valid_SDR {valid_sdr:.3f} "
                  f"best {best:.3f} {time.time() - t0:.0f}s", flush=True)
            torch.save({"state_dict": unmix.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                        "best": best}, out / f"{args.target}.chkpnt")
            if bad_epochs == 0:
                torch.save(unmix.state_dict(), out / f"{args.target}.pth")
        if bad_epochs > args.patience:
            break
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
