"""Causal (real-time) Demucs denoiser on VCTK + DEMAND.

- training: clean VCTK utterances mixed on the fly with DEMAND noise
- validation every epoch on a held-out speaker list (PESQ/STOI, all ranks)
- at the end, the best checkpoint is reloaded and scored on the official test set

    torchrun --nproc_per_node=4 15_causal_demucs_vctk.py --root /data/vctk_demand --exp exp/rt_demucs
"""
import argparse
import math
import os
import random
from pathlib import Path

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
VALID_SPEAKERS = {"p226", "p287"}


class VCTKDemand(Dataset):
    def __init__(self, clean_files, noise_files, length=SR * 4, snrs=(-5, 0, 5, 10, 15, 20)):
        self.clean_files, self.length, self.snrs = clean_files, length, snrs
        self.noises = [torchaudio.load(p)[0].mean(0) for p in noise_files]

    def __len__(self):
        return len(self.clean_files)

    def __getitem__(self, i):
        clean = torchaudio.load(self.clean_files[i])[0].mean(0)
        if clean.numel() < self.length:
            clean = F.pad(clean, (0, self.length - clean.numel()))
        o = random.randint(0, clean.numel() - self.length)
        clean = clean[o:o + self.length]
        noise = random.choice(self.noises)
        o = random.randint(0, noise.numel() - self.length)
        noise = noise[o:o + self.length]
        snr = torch.tensor([float(random.choice(self.snrs))])
        noisy = torchaudio.functional.add_noise(clean[None], noise[None], snr)[0]
        return noisy, clean


class CausalDemucs(nn.Module):
    def __init__(self, hidden=48, depth=5, kernel=8, stride=4, resample=4):
        super().__init__()
        self.depth, self.kernel, self.stride, self.resample = depth, kernel, stride, resample
        self.encoder, self.decoder = nn.ModuleList(), nn.ModuleList()
        chin = 1
        for i in range(depth):
            self.encoder.append(nn.Sequential(nn.Conv1d(chin, hidden, kernel, stride), nn.ReLU(),
                                              nn.Conv1d(hidden, 2 * hidden, 1), nn.GLU(1)))
            dec = [nn.Conv1d(hidden, 2 * hidden, 1), nn.GLU(1), nn.ConvTranspose1d(hidden, chin, kernel, stride)]
            if i > 0:
                dec.append(nn.ReLU())
            self.decoder.insert(0, nn.Sequential(*dec))
            chin, hidden = hidden, 2 * hidden
        self.lstm = nn.LSTM(chin, chin, num_layers=2, batch_first=True)  # unidirectional: causal

    def valid_length(self, n):
        n = math.ceil(n * self.resample)
        for _ in range(self.depth):
            n = max(math.ceil((n - self.kernel) / self.stride) + 1, 1)
        for _ in range(self.depth):
            n = (n - 1) * self.stride + self.kernel
        return int(math.ceil(n / self.resample))

    def forward(self, mix):
        x = mix.unsqueeze(1)
        T = x.shape[-1]
        std = x.std(-1, keepdim=True) + 1e-3
        x = F.pad(x / std, (0, self.valid_length(T) - T))
        x = torchaudio.functional.resample(x, SR, SR * self.resample)
        skips = []
        for enc in self.encoder:
            x = enc(x)
            skips.append(x)
        x = self.lstm(x.transpose(1, 2))[0].transpose(1, 2)
        for dec in self.decoder:
            x = dec(x + skips.pop()[..., : x.shape[-1]])
        x = torchaudio.functional.resample(x, SR * self.resample, SR)
        return (x[..., :T] * std).squeeze(1)


def stft_mag(x, n_fft, hop, win):
    return torch.stft(x, n_fft, hop, win, torch.hann_window(win, device=x.device), return_complex=True).abs()


def loss_fn(est, ref):
    loss = F.l1_loss(est, ref)
    for n_fft, hop, win in ((1024, 120, 600), (2048, 240, 1200), (512, 50, 240)):
        E, R = stft_mag(est, n_fft, hop, win).clamp_min(1e-7), stft_mag(ref, n_fft, hop, win).clamp_min(1e-7)
        loss = loss + 0.5 * ((R - E).norm() / R.norm() + F.l1_loss(E.log(), R.log())) / 3
    return loss


@torch.no_grad()
def score(net, pairs, device):
    """pairs: list of (noisy_path, clean_path) -- returns PESQ, STOI averaged over all ranks."""
    net.eval()
    acc = torch.zeros(3, device=device)
    for noisy_path, clean_path in pairs:
        noisy = torchaudio.load(noisy_path)[0].mean(0)
        clean = torchaudio.load(clean_path)[0].mean(0).numpy()
        est = net(noisy[None].to(device))[0].cpu().numpy()
        acc[0] += pesq(SR, clean, est, "wb")
        acc[1] += stoi(clean, est, SR)
        acc[2] += 1
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--exp", default="exp/rt_demucs")
    ap.add_argument("--epochs", type=int, default=250)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--workers", type=int, default=5)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2036)
    random.seed(2036 + rank)
    root, exp = Path(args.root), Path(args.exp)

    clean_train = sorted(str(p) for p in (root / "clean_trainset_wav").glob("*.wav"))
    train_files = [p for p in clean_train if Path(p).name.split("_")[0] not in VALID_SPEAKERS]
    valid_clean = [p for p in clean_train if Path(p).name.split("_")[0] in VALID_SPEAKERS]
    valid_pairs = [(p.replace("clean_trainset_wav", "noisy_trainset_wav"), p) for p in valid_clean]
    test_pairs = [(str(p), str(p).replace("noisy_testset_wav", "clean_testset_wav"))
                  for p in sorted((root / "noisy_testset_wav").glob("*.wav"))]
    noise_files = sorted(str(p) for p in (root / "demand").rglob("*.wav"))

    ds = VCTKDemand(train_files, noise_files)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                    pin_memory=True, drop_last=True)

    model = DDP(CausalDemucs().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    exp.mkdir(parents=True, exist_ok=True)
    start, best = 0, -1.0
    if (exp / "checkpoint.th").exists():
        ck = torch.load(exp / "checkpoint.th", map_location=device)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start, best = ck["epoch"] + 1, ck["best"]

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        run = 0.0
        for step, (noisy, clean) in enumerate(dl):
            noisy, clean = noisy.to(device, non_blocking=True), clean.to(device, non_blocking=True)
            loss = loss_fn(model(noisy), clean)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += loss.item()
        p, s = score(model.module, valid_pairs[rank::world], device)
        if rank == 0:
            print(f"epoch {epoch} train {run / (step + 1):.4f} valid PESQ {p:.3f} STOI {s:.4f}", flush=True)
            if p > best:
                best = p
                torch.save(model.state_dict(), exp / "best.th")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "best": best},
                       exp / "checkpoint.th")
        dist.barrier()

    # final evaluation of the best model on the official test set
    best_net = CausalDemucs().to(device)
    best_net.load_state_dict(torch.load(exp / "best.th", map_location=device))
    p, s = score(best_net, test_pairs[rank::world], device)
    if rank == 0:
        print(f"TEST (best valid checkpoint): PESQ {p:.3f} STOI {s:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
