"""DCCRN-lite: deep complex convolution recurrent network for speech enhancement.

* on-the-fly mixing of clean speech with noise at SNR ~ U(snr_lo, snr_hi)
* SI-SNR + compressed-magnitude loss
* validation on full utterances: PESQ (wb) and STOI, averaged over all ranks

    torchrun --nproc_per_node=8 04_dccrn_vbd.py --train-clean data/train/clean \
        --train-noise data/train/noise --valid data/valid
"""
import argparse
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pesq import pesq
from pystoi import stoi
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class STFTCfg:
    n_fft: int = 512
    hop: int = 100
    win: int = 400


class SpeechNoiseMix(Dataset):
    def __init__(self, clean_dir, noise_dir, seconds=3.0, sr=16000, snr_lo=-5.0, snr_hi=20.0):
        self.clean = sorted(Path(clean_dir).rglob("*.wav"))
        self.noise = sorted(Path(noise_dir).rglob("*.wav"))
        self.len = int(seconds * sr)
        self.snr_lo, self.snr_hi = snr_lo, snr_hi

    def __len__(self):
        return len(self.clean)

    def _segment(self, path):
        total = sf.info(str(path)).frames
        if total > self.len:
            off = random.randrange(total - self.len)
            x, _ = sf.read(str(path), start=off, frames=self.len, dtype="float32")
        else:
            x, _ = sf.read(str(path), dtype="float32")
            x = np.concatenate([x] * (self.len // max(len(x), 1) + 1))[: self.len]
        return x if x.ndim == 1 else x.mean(1)

    def __getitem__(self, idx):
        s = self._segment(self.clean[idx])
        n = self._segment(random.choice(self.noise))
        snr = random.uniform(self.snr_lo, self.snr_hi)
        n *= np.sqrt(np.sum(s ** 2) / (np.sum(n ** 2) * 10 ** (snr / 10) + 1e-10))
        level = 10 ** (random.uniform(-35, -15) / 20) / (np.sqrt(np.mean((s + n) ** 2)) + 1e-10)
        return ((s + n) * level).astype(np.float32), (s * level).astype(np.float32)


class ComplexConv2d(nn.Module):
    def __init__(self, cin, cout, k, s, p, transpose=False):
        super().__init__()
        Conv = nn.ConvTranspose2d if transpose else nn.Conv2d
        extra = {"output_padding": (1, 0)} if transpose else {}
        self.re = Conv(cin, cout, k, s, p, **extra)
        self.im = Conv(cin, cout, k, s, p, **extra)

    def forward(self, xr, xi):
        return self.re(xr) - self.im(xi), self.re(xi) + self.im(xr)


class ComplexBlock(nn.Module):
    def __init__(self, cin, cout, transpose=False, last=False):
        super().__init__()
        self.conv = ComplexConv2d(cin, cout, (5, 2), (2, 1), (2, 0), transpose)
        self.last, self.transpose = last, transpose
        if not last:
            self.bn_r, self.bn_i = nn.BatchNorm2d(cout), nn.BatchNorm2d(cout)

    def forward(self, xr, xi):
        if not self.transpose:
            # causal in time: pad one frame on the left
            xr, xi = F.pad(xr, (1, 0)), F.pad(xi, (1, 0))
        yr, yi = self.conv(xr, xi)
        if self.last:
            return yr, yi
        return F.prelu(self.bn_r(yr), yr.new_tensor([0.25])), F.prelu(self.bn_i(yi), yi.new_tensor([0.25]))


class DCCRN(nn.Module):
    def __init__(self, cfg: STFTCfg, chans=(16, 32, 64, 128, 128, 128), rnn=256):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("window", torch.hann_window(cfg.win), persistent=False)
        c = (1,) + tuple(chans)
        self.enc = nn.ModuleList([ComplexBlock(c[i], c[i + 1]) for i in range(len(chans))])
        f = cfg.n_fft // 2
        for _ in chans:
            f = (f - 1) // 2 + 1
        self.rnn = nn.LSTM(2 * chans[-1] * f, rnn, num_layers=2, batch_first=True)
        self.fc = nn.Linear(rnn, 2 * chans[-1] * f)
        self.dec = nn.ModuleList([
            ComplexBlock(2 * c[i + 1], c[i], transpose=True, last=(i == 0)) for i in reversed(range(len(chans)))
        ])

    def forward(self, wav):
        spec = torch.stft(wav, self.cfg.n_fft, self.cfg.hop, self.cfg.win, self.window, return_complex=True)
        xr, xi = spec.real[:, None, 1:], spec.imag[:, None, 1:]  # drop DC: F = n_fft // 2
        skips = []
        for blk in self.enc:
            xr, xi = blk(xr, xi)
            skips.append((xr, xi))
        b, c, f, t = xr.shape
        h = torch.cat([xr, xi], 1).permute(0, 3, 1, 2).reshape(b, t, 2 * c * f)
        h = self.fc(self.rnn(h)[0]).reshape(b, t, 2 * c, f).permute(0, 2, 3, 1)
        xr, xi = h[:, :c], h[:, c:]
        for blk in self.dec:
            sr_, si_ = skips.pop()
            xr, xi = blk(torch.cat([xr, sr_], 1), torch.cat([xi, si_], 1))
            xr, xi = xr[..., :-1], xi[..., :-1]  # keep the output causal
        mr, mi = F.pad(xr[:, 0], (0, 0, 1, 0)), F.pad(xi[:, 0], (0, 0, 1, 0))
        mag = torch.tanh(torch.sqrt(mr ** 2 + mi ** 2 + 1e-8))
        phase = torch.atan2(mi, mr)
        est = spec * torch.polar(mag, phase)
        return torch.istft(est, self.cfg.n_fft, self.cfg.hop, self.cfg.win, self.window, length=wav.shape[-1])


def si_snr_loss(est, ref):
    est = est - est.mean(-1, keepdim=True)
    ref = ref - ref.mean(-1, keepdim=True)
    t = (est * ref).sum(-1, keepdim=True) / (ref.pow(2).sum(-1, keepdim=True) + 1e-8) * ref
    return -(10 * torch.log10(t.pow(2).sum(-1) / ((est - t).pow(2).sum(-1) + 1e-8) + 1e-8)).mean()


@torch.no_grad()
def run_validation(net, valid_dir, rank, world, device, sr=16000):
    net.eval()
    names = sorted(os.listdir(os.path.join(valid_dir, "noisy")))[rank::world]
    pesq_sum, stoi_sum, count = 0.0, 0.0, 0
    for name in names:
        noisy, _ = sf.read(os.path.join(valid_dir, "noisy", name), dtype="float32")
        clean, _ = sf.read(os.path.join(valid_dir, "clean", name), dtype="float32")
        est = net(torch.from_numpy(noisy)[None].to(device))[0].cpu().numpy()
        pesq_sum += pesq(sr, clean, est, "wb")
        stoi_sum += stoi(clean, est, sr, extended=False)
        count += 1
    stats = torch.tensor([pesq_sum, stoi_sum, count], dtype=torch.float64)
    dist.all_reduce(stats)
    net.train()
    return stats[0].item() / stats[2].item(), stats[1].item() / stats[2].item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-clean", required=True)
    ap.add_argument("--train-noise", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--save-dir", default="checkpoints/dccrn")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--num-workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    torch.manual_seed(0)
    random.seed(rank)

    ds = SpeechNoiseMix(args.train_clean, args.train_noise)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
                    pin_memory=True, drop_last=True)

    net = DCCRN(STFTCfg())
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DistributedDataParallel(net, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    Path(args.save_dir).mkdir(parents=True, exist_ok=True)

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total, n = 0.0, 0
        for noisy, clean in dl:
            noisy, clean = noisy.to(device, non_blocking=True), clean.to(device, non_blocking=True)
            loss = si_snr_loss(model(noisy), clean)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            total, n = total + loss.item(), n + 1
        sched.step()
        logging.info("epoch %d train si-snr loss %.3f", epoch, total / max(n, 1))

        v_pesq, v_stoi = run_validation(net, args.valid, rank, world, device)
        logging.info("epoch %d valid PESQ %.3f STOI %.4f", epoch, v_pesq, v_stoi)
        if rank == 0:
            ckpt = {"epoch": epoch, "model": net.state_dict(), "optim": opt.state_dict(),
                    "sched": sched.state_dict(), "pesq": v_pesq}
            torch.save(ckpt, os.path.join(args.save_dir, f"epoch{epoch:03d}.pt"))
            if v_pesq > best:
                best = v_pesq
                torch.save(ckpt, os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
