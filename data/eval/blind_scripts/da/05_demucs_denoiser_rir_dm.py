"""Causal Demucs denoiser with on-the-fly reverberation + noise mixing.

Usage:
  torchrun --standalone --nproc_per_node=4 05_demucs_denoiser_rir_dm.py \
      --clean /data/dns/clean_fullband_16k --noise /data/dns/noise_16k --rir /data/rirs/simulated \
      --test /data/valentini16k --out exp/demucs_dm
"""
import argparse
import glob
import math
import os
import random

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from pesq import pesq
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SR = 16000


class ReverbNoiseMix(Dataset):
    def __init__(self, clean_dir, noise_dir, rir_dir, device, segment=4.0, snr=(0, 25), p_reverb=0.5):
        self.clean = sorted(glob.glob(f"{clean_dir}/**/*.wav", recursive=True))
        self.noise = sorted(glob.glob(f"{noise_dir}/**/*.wav", recursive=True))
        self.device = device
        self.rirs = []
        for path in sorted(glob.glob(f"{rir_dir}/**/*.wav", recursive=True)):
            rir, _ = sf.read(path, dtype="float32")
            rir = rir if rir.ndim == 1 else rir[:, 0]
            self.rirs.append(torch.from_numpy(rir / (np.abs(rir).max() + 1e-8)).to(device))
        self.seg = int(segment * SR)
        self.snr = snr
        self.p_reverb = p_reverb

    def __len__(self):
        return len(self.clean)

    def _load(self, path):
        n = sf.info(path).frames
        off = random.randint(0, max(0, n - self.seg))
        x, _ = sf.read(path, start=off, stop=off + self.seg, dtype="float32")
        return np.pad(x, (0, self.seg - len(x)))

    def __getitem__(self, idx):
        clean = torch.from_numpy(self._load(self.clean[idx])).to(self.device)
        noise = torch.from_numpy(self._load(random.choice(self.noise))).to(self.device)
        target = clean
        if random.random() < self.p_reverb:
            rir = random.choice(self.rirs)
            reverbed = torchaudio.functional.fftconvolve(clean, rir)[: self.seg]
            peak = int(torch.argmax(rir.abs()))
            direct = rir[: peak + int(0.05 * SR)]
            target = torchaudio.functional.fftconvolve(clean, direct)[: self.seg]
            clean = reverbed
        snr = random.uniform(*self.snr)
        gain = torch.sqrt(clean.pow(2).mean() / (noise.pow(2).mean() * 10 ** (snr / 10) + 1e-8))
        noisy = clean + gain * noise
        peak = noisy.abs().max().clamp_min(1.0)
        return (noisy / peak).cpu(), (target / peak).cpu()


class Demucs(nn.Module):
    def __init__(self, chin=1, hidden=48, depth=5, kernel=8, stride=4, growth=2, max_hidden=10000, floor=1e-3):
        super().__init__()
        self.depth, self.kernel, self.stride, self.floor = depth, kernel, stride, floor
        self.encoder, self.decoder = nn.ModuleList(), nn.ModuleList()
        ch = chin
        for i in range(depth):
            self.encoder.append(nn.Sequential(nn.Conv1d(ch, hidden, kernel, stride), nn.ReLU(),
                                              nn.Conv1d(hidden, 2 * hidden, 1), nn.GLU(1)))
            dec = [nn.Conv1d(hidden, 2 * hidden, 1), nn.GLU(1), nn.ConvTranspose1d(hidden, ch, kernel, stride)]
            if i > 0:
                dec.append(nn.ReLU())
            self.decoder.insert(0, nn.Sequential(*dec))
            ch = hidden
            hidden = min(int(growth * hidden), max_hidden)
        self.lstm = nn.LSTM(ch, ch, num_layers=2)

    def valid_length(self, length):
        for _ in range(self.depth):
            length = max(math.ceil((length - self.kernel) / self.stride) + 1, 1)
        for _ in range(self.depth):
            length = (length - 1) * self.stride + self.kernel
        return int(length)

    def forward(self, mix):
        x = mix.unsqueeze(1)
        std = x.std(dim=-1, keepdim=True)
        x = x / (self.floor + std)
        length = x.shape[-1]
        x = F.pad(x, (0, self.valid_length(length) - length))
        skips = []
        for enc in self.encoder:
            x = enc(x)
            skips.append(x)
        x, _ = self.lstm(x.permute(2, 0, 1))
        x = x.permute(1, 2, 0)
        for dec in self.decoder:
            x = dec(x + skips.pop()[..., : x.shape[-1]])
        return (std * x[..., :length]).squeeze(1)


class MultiResSTFTLoss(nn.Module):
    def __init__(self, ffts=(512, 1024, 2048), hops=(50, 120, 240), wins=(240, 600, 1200)):
        super().__init__()
        self.cfg = list(zip(ffts, hops, wins))
        for i, (_, _, w) in enumerate(self.cfg):
            self.register_buffer(f"win{i}", torch.hann_window(w), persistent=False)

    def forward(self, est, ref):
        loss = 0.0
        for i, (n, h, w) in enumerate(self.cfg):
            win = getattr(self, f"win{i}")
            E = torch.stft(est, n, h, w, win, return_complex=True).abs().clamp_min(1e-7)
            R = torch.stft(ref, n, h, w, win, return_complex=True).abs().clamp_min(1e-7)
            sc = torch.norm(R - E, p="fro") / torch.norm(R, p="fro")
            mag = F.l1_loss(torch.log(E), torch.log(R))
            loss = loss + sc + mag
        return loss / len(self.cfg)


@torch.no_grad()
def evaluate(model, test_dir, device, rank, world):
    files = sorted(glob.glob(os.path.join(test_dir, "noisy_testset_wav", "*.wav")))[rank::world]
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for f in files:
        noisy, _ = sf.read(f, dtype="float32")
        clean, _ = sf.read(f.replace("noisy_testset_wav", "clean_testset_wav"), dtype="float32")
        enh = model(torch.from_numpy(noisy).to(device)[None])[0].cpu().numpy()
        acc[0] += pesq(SR, clean, enh, "wb")
        acc[1] += 1
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--clean", required=True)
    p.add_argument("--noise", required=True)
    p.add_argument("--rir", required=True)
    p.add_argument("--test", required=True)
    p.add_argument("--out", default="exp/demucs_dm")
    p.add_argument("--epochs", type=int, default=400)
    p.add_argument("--batch_size", type=int, default=16, help="per GPU, 4 GPUs -> 64")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--eval_every", type=int, default=10)
    args = p.parse_args()

    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    random.seed(1000 + rank)

    dataset = ReverbNoiseMix(args.clean, args.noise, args.rir, device)
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        drop_last=True, pin_memory=True)

    model = DDP(Demucs().to(device), device_ids=[local_rank])
    stft_loss = MultiResSTFTLoss().to(device)
    optim = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_pesq = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        total = torch.zeros(2, device=device)
        for noisy, target in loader:
            noisy, target = noisy.to(device, non_blocking=True), target.to(device, non_blocking=True)
            est = model(noisy)
            loss = F.l1_loss(est, target) + stft_loss(est, target)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            total += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch} train loss {(total[0] / total[1]).item():.4f}", flush=True)

        if (epoch + 1) % args.eval_every == 0:
            model.eval()
            score = evaluate(model.module, args.test, device, rank, world)
            if rank == 0:
                print(f"epoch {epoch} valentini PESQ {score:.3f}", flush=True)
                if score > best_pesq:
                    best_pesq = score
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best.th"))
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "checkpoint.th"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
