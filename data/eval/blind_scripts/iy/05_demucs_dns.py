"""Waveform Demucs denoiser trained on LibriSpeech-style speakers + DNS noise.

A held-out group of speakers is used for validation; noise for validation
mixtures is drawn with a per-utterance seed so the validation set is fixed.

    torchrun --nproc_per_node=4 05_demucs_dns.py --speech-root /data/libri_16k \
        --noise-root /data/dns_noise --exp exp/demucs48
"""
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
from pesq import pesq
from pystoi import stoi
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

SR = 16000


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def speaker_of(path):
    # .../<speaker>/<chapter>/<utt>.flac
    return Path(path).parts[-3]


def load_mono(path):
    wav, sr = torchaudio.load(path)
    if sr != SR:
        wav = torchaudio.functional.resample(wav, sr, SR)
    return wav.mean(0)


def mix(clean, noise, snr_db):
    if noise.numel() < clean.numel():
        noise = noise.repeat(math.ceil(clean.numel() / noise.numel()))
    noise = noise[: clean.numel()]
    g = clean.norm() / (noise.norm() + 1e-7) * 10 ** (-snr_db / 20)
    return clean + g * noise


class TrainSet(Dataset):
    def __init__(self, files, noise_files, seconds, snr):
        self.files, self.noise_files = files, noise_files
        self.n = int(seconds * SR)
        self.snr = snr

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        clean = load_mono(self.files[i])
        if clean.numel() < self.n:
            clean = F.pad(clean, (0, self.n - clean.numel()))
        off = random.randint(0, clean.numel() - self.n)
        clean = clean[off:off + self.n]
        noise = load_mono(random.choice(self.noise_files))
        noff = random.randint(0, max(noise.numel() - self.n, 0))
        noisy = mix(clean, noise[noff:], random.uniform(*self.snr))
        return noisy, clean


class ValidSet(Dataset):
    def __init__(self, files, noise_files, snrs=(0.0, 5.0, 10.0)):
        self.files, self.noise_files, self.snrs = files, noise_files, snrs

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        rng = random.Random(i)
        clean = load_mono(self.files[i])
        noise = load_mono(self.noise_files[rng.randrange(len(self.noise_files))])
        return mix(clean, noise, rng.choice(self.snrs)), clean


class Demucs(nn.Module):
    def __init__(self, chin=1, hidden=48, depth=5, kernel=8, stride=4, growth=2, max_hidden=10000):
        super().__init__()
        self.depth, self.kernel, self.stride = depth, kernel, stride
        self.encoder, self.decoder = nn.ModuleList(), nn.ModuleList()
        ch = chin
        for i in range(depth):
            self.encoder.append(nn.Sequential(
                nn.Conv1d(ch, hidden, kernel, stride), nn.ReLU(), nn.Conv1d(hidden, 2 * hidden, 1), nn.GLU(1)))
            dec = [nn.Conv1d(hidden, 2 * hidden, 1), nn.GLU(1), nn.ConvTranspose1d(hidden, ch, kernel, stride)]
            if i > 0:
                dec.append(nn.ReLU())
            self.decoder.insert(0, nn.Sequential(*dec))
            ch, hidden = hidden, min(int(growth * hidden), max_hidden)
        self.lstm = nn.LSTM(ch, ch, num_layers=2, bidirectional=True, batch_first=True)
        self.lstm_proj = nn.Linear(2 * ch, ch)

    def valid_length(self, length):
        for _ in range(self.depth):
            length = max(math.ceil((length - self.kernel) / self.stride) + 1, 1)
        for _ in range(self.depth):
            length = (length - 1) * self.stride + self.kernel
        return int(length)

    def forward(self, x):
        x = x.unsqueeze(1)
        length = x.shape[-1]
        std = x.std(dim=-1, keepdim=True) + 1e-3
        x = F.pad(x / std, (0, self.valid_length(length) - length))
        skips = []
        for enc in self.encoder:
            x = enc(x)
            skips.append(x)
        y, _ = self.lstm(x.transpose(1, 2))
        x = self.lstm_proj(y).transpose(1, 2)
        for dec in self.decoder:
            skip = skips.pop()
            x = dec(x + skip[..., : x.shape[-1]])
        return (x[..., :length] * std).squeeze(1)


class MultiResSTFTLoss(nn.Module):
    def __init__(self, ffts=(512, 1024, 2048), hops=(50, 120, 240), wins=(240, 600, 1200)):
        super().__init__()
        self.res = list(zip(ffts, hops, wins))
        for i, (_, _, w) in enumerate(self.res):
            self.register_buffer(f"win{i}", torch.hann_window(w), persistent=False)

    def forward(self, est, ref):
        total = 0.0
        for i, (n, h, w) in enumerate(self.res):
            win = getattr(self, f"win{i}")
            E = torch.stft(est, n, h, w, win, return_complex=True).abs().clamp_min(1e-7)
            R = torch.stft(ref, n, h, w, win, return_complex=True).abs().clamp_min(1e-7)
            total = total + torch.norm(R - E, p="fro") / torch.norm(R, p="fro") + F.l1_loss(E.log(), R.log())
        return total / len(self.res)


@torch.no_grad()
def evaluate(net, valid_set, rank, world, device):
    net.eval()
    s = torch.zeros(3, device=device)
    for i in range(rank, len(valid_set), world):
        noisy, clean = valid_set[i]
        est = net(noisy[None].to(device))[0].cpu().numpy()
        ref = clean.numpy()
        s[0] += pesq(SR, ref, est, "wb")
        s[1] += stoi(ref, est, SR)
        s[2] += 1
    dist.all_reduce(s)
    net.train()
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--speech-root", required=True)
    ap.add_argument("--noise-root", required=True)
    ap.add_argument("--exp", default="exp/demucs")
    ap.add_argument("--valid-frac", type=float, default=0.05)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--snr", type=float, nargs=2, default=(-5.0, 20.0))
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different augmentation draws on every GPU
    seed_everything(args.seed + rank)

    speech = sorted(str(p) for p in Path(args.speech_root).rglob("*.flac"))
    noise = sorted(str(p) for p in Path(args.noise_root).rglob("*.wav"))
    speakers = sorted({speaker_of(p) for p in speech})
    random.shuffle(speakers)
    n_valid = max(1, int(len(speakers) * args.valid_frac))
    valid_spk = set(speakers[:n_valid])
    train_files = [p for p in speech if speaker_of(p) not in valid_spk]
    valid_files = [p for p in speech if speaker_of(p) in valid_spk][:400]

    train_set = TrainSet(train_files, noise, args.seconds, args.snr)
    valid_set = ValidSet(valid_files, noise)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)

    net = Demucs().to(device)
    model = DDP(net, device_ids=[local_rank])
    criterion = MultiResSTFTLoss().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    os.makedirs(args.exp, exist_ok=True)
    if rank == 0:
        print(f"{len(speakers)} speakers ({n_valid} held out), {len(train_files)} train utterances", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, acc = time.time(), 0.0
        for step, (noisy, clean) in enumerate(loader):
            noisy, clean = noisy.to(device, non_blocking=True), clean.to(device, non_blocking=True)
            est = model(noisy)
            loss = F.l1_loss(est, clean) + criterion(est, clean)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += loss.item()
        if rank == 0:
            print(f"epoch {epoch} loss {acc / (step + 1):.4f} ({time.time() - t0:.0f}s)", flush=True)

        if epoch % 5 == 4:
            p, s = evaluate(net, valid_set, rank, world, device)
            if rank == 0:
                print(f"epoch {epoch} valid PESQ {p:.3f} STOI {s:.4f}", flush=True)
                state = {"model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                         "pesq": p, "args": vars(args)}
                torch.save(state, os.path.join(args.exp, "checkpoint.th"))
                if p > best:
                    best = p
                    torch.save(net.state_dict(), os.path.join(args.exp, "best.th"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
