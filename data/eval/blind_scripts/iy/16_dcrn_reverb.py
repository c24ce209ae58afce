"""Joint denoising + dereverberation with a complex-spectrum CRN (GRU bottleneck).

Each training example: clean speech convolved with a random measured/simulated
RIR, plus noise at a random SNR. The target is the early-reverberation part
(direct path + 50 ms), which keeps the training target natural-sounding.
RIR convolution of 4 s segments is FFT-based and done on the GPU.

    torchrun --nproc_per_node=4 16_dcrn_reverb.py --clean-list lists/clean.txt \
        --noise-list lists/noise.txt --rir-list lists/rirs.txt --valid-dir /data/reverb_valid
"""
import argparse
import os
import random

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio.functional as AF
from pesq import pesq
from pystoi import stoi
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SR, N_FFT, HOP = 16000, 512, 128
EARLY_MS = 50


def read_list(path):
    with open(path) as f:
        return [l.strip() for l in f if l.strip()]


class ReverbNoisyMix(Dataset):
    def __init__(self, clean, noise, rirs, device, seconds=4.0, snr=(-5.0, 20.0), p_reverb=0.75):
        self.clean, self.noise, self.rirs = clean, noise, rirs
        self.device = device
        self.n = int(seconds * SR)
        self.snr, self.p_reverb = snr, p_reverb

    def __len__(self):
        return len(self.clean)

    def _seg(self, path):
        frames = sf.info(path).frames
        st = random.randint(0, max(frames - self.n, 0))
        x, _ = sf.read(path, start=st, frames=self.n, dtype="float32", fill_value=0.0, always_2d=True)
        return torch.from_numpy(x[:, 0].copy())

    def __getitem__(self, i):
        clean = self._seg(self.clean[i]).to(self.device)
        noise = self._seg(random.choice(self.noise)).to(self.device)
        if random.random() < self.p_reverb:
            rir, _ = sf.read(random.choice(self.rirs), dtype="float32", always_2d=True)
            rir = torch.from_numpy(rir[:, 0].copy()).to(self.device)
            rir = rir / (rir.abs().max() + 1e-8)
            peak = int(rir.abs().argmax())
            early = rir[: peak + int(EARLY_MS * SR / 1000)]
            reverberant = AF.fftconvolve(clean, rir)[: self.n]
            target = AF.fftconvolve(clean, early)[: self.n]
            # keep the direct-path level of the target equal to the dry signal
            scale = clean.norm() / (target.norm() + 1e-8)
            reverberant, target = reverberant * scale, target * scale
        else:
            reverberant, target = clean, clean
        snr = random.uniform(*self.snr)
        noise = noise * reverberant.norm() / (noise.norm() + 1e-8) * 10 ** (-snr / 20)
        noisy = reverberant + noise
        peak = noisy.abs().max().clamp_min(1.0)
        return (noisy / peak).cpu(), (target / peak).cpu()


class DCRN(nn.Module):
    def __init__(self, chans=(32, 64, 128, 128, 256), hidden=512):
        super().__init__()
        c = (2,) + chans
        self.enc = nn.ModuleList([nn.Sequential(nn.Conv2d(c[i], c[i + 1], (2, 3), (1, 2), (1, 0)),
                                                nn.GroupNorm(1, c[i + 1]), nn.PReLU())
                                  for i in range(len(chans))])
        f = N_FFT // 2 + 1
        for _ in chans:
            f = (f - 3) // 2 + 1
        self.gru = nn.GRU(chans[-1] * f, hidden, num_layers=2, batch_first=True)
        self.fc = nn.Linear(hidden, chans[-1] * f)
        dec = []
        for i in reversed(range(len(chans))):
            last = i == 0
            layers = [nn.ConvTranspose2d(2 * c[i + 1], c[i], (2, 3), (1, 2), (1, 0))]
            if not last:
                layers += [nn.GroupNorm(1, c[i]), nn.PReLU()]
            dec.append(nn.Sequential(*layers))
        self.dec = nn.ModuleList(dec)

    def forward(self, spec):
        # spec: complex (B, F, T); predicts a complex ratio mask
        x = torch.stack([spec.real, spec.imag], 1).transpose(2, 3)  # B,2,T,F
        T = x.shape[2]
        skips = []
        for layer in self.enc:
            x = layer(x)[:, :, :T]
            skips.append(x)
        b, c, t, f = x.shape
        h = self.fc(self.gru(x.permute(0, 2, 1, 3).reshape(b, t, c * f))[0])
        x = h.reshape(b, t, c, f).permute(0, 2, 1, 3)
        for layer in self.dec:
            s = skips.pop()
            x = layer(torch.cat([x, s], 1))[:, :, :T]
            if skips:
                x = F.pad(x, (0, skips[-1].shape[-1] - x.shape[-1]))
        x = F.pad(x, (0, spec.shape[1] - x.shape[-1]))
        mr, mi = x[:, 0].transpose(1, 2), x[:, 1].transpose(1, 2)
        return torch.complex(spec.real * mr - spec.imag * mi, spec.real * mi + spec.imag * mr)


def sisdr(est, ref, eps=1e-8):
    a = (est * ref).sum(-1, keepdim=True) / (ref.pow(2).sum(-1, keepdim=True) + eps)
    return 10 * torch.log10((a * ref).pow(2).sum(-1) / ((est - a * ref).pow(2).sum(-1) + eps) + eps)


@torch.no_grad()
def validate(net, names, valid_dir, window, device):
    net.eval()
    sums = torch.zeros(3, device=device)
    for name in names:
        noisy, _ = sf.read(os.path.join(valid_dir, "noisy", name), dtype="float32")
        target, _ = sf.read(os.path.join(valid_dir, "target", name), dtype="float32")
        x = torch.from_numpy(noisy).to(device)[None]
        spec = torch.stft(x, N_FFT, HOP, window=window, return_complex=True)
        est = torch.istft(net(spec), N_FFT, HOP, window=window, length=x.shape[-1])[0].cpu().numpy()
        sums[0] += pesq(SR, target, est, "wb")
        sums[1] += stoi(target, est, SR)
        sums[2] += 1
    dist.all_reduce(sums)
    net.train()
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clean-list", required=True)
    ap.add_argument("--noise-list", required=True)
    ap.add_argument("--rir-list", required=True)
    ap.add_argument("--valid-dir", required=True)
    ap.add_argument("--exp", default="exp/dcrn_reverb")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(99)
    random.seed(99 + rank)

    net = DCRN().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=1e-5)
    window = torch.hann_window(N_FFT, device=device)

    ds = ReverbNoisyMix(read_list(args.clean_list), read_list(args.noise_list), read_list(args.rir_list), device)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                    drop_last=True, persistent_workers=True)
    valid_names = sorted(os.listdir(os.path.join(args.valid_dir, "noisy")))[rank::world]
    os.makedirs(args.exp, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (noisy, target) in enumerate(dl):
            noisy, target = noisy.to(device, non_blocking=True), target.to(device, non_blocking=True)
            n_spec = torch.stft(noisy, N_FFT, HOP, window=window, return_complex=True)
            t_spec = torch.stft(target, N_FFT, HOP, window=window, return_complex=True)
            e_spec = model(n_spec)
            e_wav = torch.istft(e_spec, N_FFT, HOP, window=window, length=noisy.shape[-1])
            loss = F.mse_loss(torch.view_as_real(e_spec), torch.view_as_real(t_spec)) * 100 \
                - 0.05 * sisdr(e_wav, target).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f}", flush=True)
        sched.step()

        p, s = validate(net, valid_names, args.valid_dir, window, device)
        if rank == 0:
            print(f"ep {epoch} valid PESQ {p:.3f} STOI {s:.4f}", flush=True)
            torch.save({"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict()},
                       os.path.join(args.exp, "last.pt"))
            if p > best:
                best = p
                torch.save(net.state_dict(), os.path.join(args.exp, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
