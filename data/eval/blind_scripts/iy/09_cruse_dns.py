"""CRUSE-style real-time denoiser (conv encoder / GRU / conv decoder, skip 1x1 convs).

The DNS noise corpus is ~60k files of mixed sample rates; reading and resampling
them inside the DataLoader is far too slow, so all noise is resampled once into a
single float16 array ("noise bank") that the workers memory-map and slice at
random offsets.

    torchrun --nproc_per_node=8 09_cruse_dns.py --clean-list lists/clean.txt \
        --noise-dir /data/DNS/noise --cache-dir /scratch/cruse_cache --valid-dir /data/DNS/test_synthetic
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
import torchaudio
from pesq import pesq
from pystoi import stoi
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

SR, N_FFT, HOP = 16000, 512, 256


def build_noise_bank(noise_dir, cache_dir):
    cache_dir = Path(cache_dir)
    bank_path, index_path = cache_dir / "noise_bank.npy", cache_dir / "noise_bank.json"
    if bank_path.exists() and index_path.exists():
        return str(bank_path), json.loads(index_path.read_text())
    cache_dir.mkdir(parents=True, exist_ok=True)
    chunks, index, pos = [], [], 0
    for f in sorted(Path(noise_dir).rglob("*.wav")):
        wav, sr = torchaudio.load(str(f))
        wav = wav.mean(0)
        if sr != SR:
            wav = torchaudio.functional.resample(wav, sr, SR)
        if wav.numel() < SR:
            continue
        chunks.append(wav.numpy().astype(np.float16))
        index.append([f.name, pos, wav.numel()])
        pos += wav.numel()
    np.save(bank_path, np.concatenate(chunks))
    index_path.write_text(json.dumps(index))
    return str(bank_path), index


class MixWithBank(Dataset):
    def __init__(self, clean_files, bank_path, bank_index, seconds=4.0, snr=(-5.0, 20.0)):
        self.clean_files = clean_files
        self.bank_path, self.bank_index = bank_path, bank_index
        self.bank = None  # opened lazily in each worker
        self.n = int(seconds * SR)
        self.snr = snr

    def __len__(self):
        return len(self.clean_files)

    def __getitem__(self, i):
        if self.bank is None:
            self.bank = np.load(self.bank_path, mmap_mode="r")
        clean, _ = sf.read(self.clean_files[i], dtype="float32")
        if len(clean) < self.n:
            clean = np.pad(clean, (0, self.n - len(clean)))
        o = random.randint(0, len(clean) - self.n)
        clean = clean[o:o + self.n]
        _, start, length = random.choice(self.bank_index)
        if length > self.n:
            start += random.randint(0, length - self.n)
        noise = np.asarray(self.bank[start:start + self.n], dtype=np.float32)
        if len(noise) < self.n:
            noise = np.resize(noise, self.n)
        snr = random.uniform(*self.snr)
        noise *= np.sqrt((clean ** 2).mean() / ((noise ** 2).mean() + 1e-9)) * 10 ** (-snr / 20)
        return torch.from_numpy(clean + noise), torch.from_numpy(clean)


class CRUSE(nn.Module):
    def __init__(self, chans=(16, 32, 64, 128), gru_groups=4):
        super().__init__()
        self.register_buffer("window", torch.sqrt(torch.hann_window(N_FFT) + 1e-12), persistent=False)
        c = (1,) + chans
        self.enc = nn.ModuleList([nn.Conv2d(c[i], c[i + 1], (2, 3), (1, 2), (0, 1)) for i in range(4)])
        self.skip = nn.ModuleList([nn.Conv2d(c[i + 1], c[i + 1], 1) for i in range(4)])
        self.dec = nn.ModuleList([nn.ConvTranspose2d(c[i + 1], c[i], (2, 3), (1, 2), (1, 1)) for i in range(4)])
        f = 17
        self.groups = gru_groups
        width = chans[-1] * f
        self.grus = nn.ModuleList([nn.GRU(width // gru_groups, width // gru_groups, batch_first=True)
                                   for _ in range(gru_groups)])

    def forward(self, wav):
        spec = torch.stft(wav, N_FFT, HOP, window=self.window, return_complex=True)  # B,F,T
        x = torch.log10(spec.abs().pow(2) + 1e-8).transpose(1, 2).unsqueeze(1)       # B,1,T,F
        skips = []
        for conv in self.enc:
            x = F.leaky_relu(conv(F.pad(x, (0, 0, 1, 0))), 0.2)  # causal along time
            skips.append(x)
        b, c, t, f = x.shape
        h = x.permute(0, 2, 1, 3).reshape(b, t, c * f)
        h = torch.cat([g(part)[0] for g, part in zip(self.grus, h.chunk(self.groups, -1))], -1)
        x = h.reshape(b, t, c, f).permute(0, 2, 1, 3)
        for i in reversed(range(4)):
            x = self.dec[i](x + self.skip[i](skips[i]))[:, :, :t]
            if i > 0:
                x = F.leaky_relu(x, 0.2)
        mask = torch.sigmoid(x.squeeze(1)).transpose(1, 2)
        return torch.istft(spec * mask, N_FFT, HOP, window=self.window, length=wav.shape[-1])


def compressed_spec_loss(est, ref, window, c=0.3, lam=0.3):
    E = torch.stft(est, N_FFT, HOP, window=window, return_complex=True)
    R = torch.stft(ref, N_FFT, HOP, window=window, return_complex=True)
    Em, Rm = E.abs().clamp_min(1e-8), R.abs().clamp_min(1e-8)
    Ec, Rc = Em ** c * E / Em, Rm ** c * R / Rm
    return (1 - lam) * F.mse_loss(Em ** c, Rm ** c) + lam * (Ec - Rc).abs().pow(2).mean()


@torch.no_grad()
def evaluate(net, valid_dir, rank, world, device):
    net.eval()
    files = sorted(Path(valid_dir, "noisy").glob("*.wav"))
    acc = torch.zeros(3, device=device)
    for nf in files[rank::world]:
        noisy, _ = sf.read(nf, dtype="float32")
        clean, _ = sf.read(Path(valid_dir, "clean", nf.name), dtype="float32")
        est = net(torch.from_numpy(noisy).to(device)[None])[0].cpu().numpy()
        acc[0] += pesq(SR, clean, est, "wb")
        acc[1] += stoi(clean, est, SR)
        acc[2] += 1
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clean-list", required=True)
    ap.add_argument("--noise-dir", required=True)
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--valid-dir", required=True)
    ap.add_argument("--exp", default="exp/cruse")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(0)
    random.seed(rank)

    t0 = time.time()
    bank_path, bank_index = build_noise_bank(args.noise_dir, args.cache_dir)
    if rank == 0:
        print(f"noise bank ready: {len(bank_index)} files ({time.time() - t0:.0f}s)", flush=True)
    clean_files = [l.strip() for l in open(args.clean_list) if l.strip()]

    ds = MixWithBank(clean_files, bank_path, bank_index)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                    pin_memory=True, drop_last=True, persistent_workers=True)

    net = CRUSE().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(dl))
    os.makedirs(args.exp, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (noisy, clean) in enumerate(dl):
            noisy, clean = noisy.to(device, non_blocking=True), clean.to(device, non_blocking=True)
            loss = compressed_spec_loss(model(noisy), clean, net.window)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 3.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 250 == 0:
                print(f"ep {epoch} step {step}/{len(dl)} loss {loss.item():.4f}", flush=True)

        p, s = evaluate(net, args.valid_dir, rank, world, device)
        if rank == 0:
            print(f"ep {epoch} PESQ {p:.3f} STOI {s:.4f}", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.exp, "last.pt"))
            if p > best:
                best = p
                torch.save(net.state_dict(), os.path.join(args.exp, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
