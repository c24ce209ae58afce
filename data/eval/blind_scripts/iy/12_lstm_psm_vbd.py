"""LSTM phase-sensitive-mask (PSM) estimator -- classic recurrent baseline for
single-channel speech enhancement.

Features: log-magnitude STFT with global mean/variance normalisation.
Target: truncated phase-sensitive mask. Training mixtures are generated on
the fly from clean speech and noise at SNRs drawn uniformly from a range.

    torchrun --nproc_per_node=4 12_lstm_psm_vbd.py --data-root /data/vbd --stats stats/vbd_logmag.npz
"""
import argparse
import glob
import os
import random
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
from pesq import pesq
from pystoi import stoi
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

FS, NFFT, HOP = 16000, 512, 128


def get_parser():
    parser = argparse.ArgumentParser(description="LSTM-PSM speech enhancement")
    parser.add_argument("--data-root", type=str, required=True)
    parser.add_argument("--stats", type=str, required=True, help="npz with mean/std of log-magnitude")
    parser.add_argument("--exp-dir", type=str, default="exp/lstm_psm")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--seg-sec", type=float, default=3.0)
    parser.add_argument("--snr", type=float, nargs=2, default=[-5.0, 15.0])
    parser.add_argument("--num-workers", type=int, default=4)
    return parser


class MixingDataset(Dataset):
    def __init__(self, clean_files, noise_files, seg_sec, snr):
        self.clean_files, self.noise_files = clean_files, noise_files
        self.seg = int(seg_sec * FS)
        self.snr = snr

    def __len__(self):
        return len(self.clean_files)

    def _load_seg(self, path):
        x, _ = sf.read(path, dtype="float32")
        if x.ndim > 1:
            x = x[:, 0]
        if len(x) < self.seg:
            x = np.tile(x, self.seg // len(x) + 1)
        st = random.randint(0, len(x) - self.seg)
        return x[st:st + self.seg]

    def __getitem__(self, idx):
        clean = self._load_seg(self.clean_files[idx])
        noise = self._load_seg(random.choice(self.noise_files))
        snr = random.uniform(*self.snr)
        a = np.sqrt(np.sum(clean ** 2) / (np.sum(noise ** 2) + 1e-12) / (10 ** (snr / 10)))
        noisy = (clean + a * noise).astype(np.float32)
        return torch.from_numpy(noisy), torch.from_numpy(clean)


class LSTMMask(nn.Module):
    def __init__(self, n_freq, hidden, layers, mean, std):
        super().__init__()
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32))
        self.lstm = nn.LSTM(n_freq, hidden, num_layers=layers, batch_first=True, dropout=0.1)
        self.out = nn.Linear(hidden, n_freq)

    def forward(self, mag):
        # mag: B, F, T
        feat = (torch.log(mag + 1e-6).transpose(1, 2) - self.mean) / self.std
        h, _ = self.lstm(feat)
        return torch.sigmoid(self.out(h)).transpose(1, 2)


def psm_target(noisy_spec, clean_spec):
    psm = clean_spec.abs() / (noisy_spec.abs() + 1e-8) * torch.cos(clean_spec.angle() - noisy_spec.angle())
    return psm.clamp(0.0, 1.0)


@torch.no_grad()
def evaluate(net, pairs, window, device):
    net.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for noisy_path, clean_path in pairs:
        noisy, _ = sf.read(noisy_path, dtype="float32")
        clean, _ = sf.read(clean_path, dtype="float32")
        x = torch.from_numpy(noisy).to(device)
        spec = torch.stft(x, NFFT, HOP, window=window, return_complex=True)
        mask = net(spec.abs()[None])[0]
        est = torch.istft(spec * mask, NFFT, HOP, window=window, length=len(noisy)).cpu().numpy()
        sums[0] += pesq(FS, clean, est, "wb")
        sums[1] += stoi(clean, est, FS)
        sums[2] += 1
    dist.all_reduce(sums)
    net.train()
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(1)
    random.seed(1 + rank)

    clean = sorted(glob.glob(os.path.join(args.data_root, "clean_trainset_28spk_wav_16k", "*.wav")))
    noise = sorted(glob.glob(os.path.join(args.data_root, "noise_16k", "**", "*.wav"), recursive=True))
    test_noisy = sorted(glob.glob(os.path.join(args.data_root, "noisy_testset_wav_16k", "*.wav")))
    test_pairs = [(p, p.replace("noisy_testset_wav_16k", "clean_testset_wav_16k")) for p in test_noisy]
    stats = np.load(args.stats)

    train_set = MixingDataset(clean, noise, args.seg_sec, args.snr)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.num_workers, pin_memory=True, drop_last=True)

    net = LSTMMask(NFFT // 2 + 1, args.hidden, args.layers, stats["mean"], stats["std"]).to(device)
    model = DDP(net, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=2)
    window = torch.hann_window(NFFT, device=device)
    if rank == 0:
        os.makedirs(args.exp_dir, exist_ok=True)
        print(f"world={world} train={len(train_set)} test={len(test_pairs)}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic, total, count = time.time(), 0.0, 0
        for noisy, clean in loader:
            noisy, clean = noisy.to(device, non_blocking=True), clean.to(device, non_blocking=True)
            n_spec = torch.stft(noisy, NFFT, HOP, window=window, return_complex=True)
            c_spec = torch.stft(clean, NFFT, HOP, window=window, return_complex=True)
            mask = model(n_spec.abs())
            # phase-sensitive spectrum approximation loss on the magnitude domain
            loss = ((mask - psm_target(n_spec, c_spec)) * n_spec.abs()).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            total += loss.item()
            count += 1

        p, s = evaluate(net, test_pairs[rank::world], window, device)
        scheduler.step(p)
        if rank == 0:
            print(f"epoch {epoch:02d} loss {total / max(count, 1):.5f} PESQ {p:.3f} STOI {s:.4f} "
                  f"({time.time() - tic:.0f}s)", flush=True)
            torch.save({"epoch": epoch, "model": net.state_dict(), "optimizer": optimizer.state_dict()},
                       os.path.join(args.exp_dir, "last.pt"))
            if p > best:
                best = p
                torch.save(net.state_dict(), os.path.join(args.exp_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
