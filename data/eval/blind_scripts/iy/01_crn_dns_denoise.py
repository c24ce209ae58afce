#!/usr/bin/env python3
"""CRN (convolutional recurrent network) speech enhancement on DNS-style data.

Clean speech and noise are mixed on the fly at a random SNR. The model predicts
a magnitude mask on a 320-point STFT; the noisy phase is reused for synthesis.

    torchrun --nproc_per_node=4 01_crn_dns_denoise.py \
        --clean-dir /data/dns/clean --noise-dir /data/dns/noise \
        --val-dir /data/vbd/test --out-dir exp/crn_dns
"""
import argparse
import glob
import logging
import math
import os
import random
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pesq import pesq
from pystoi import stoi
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SR = 16000
N_FFT = 320
HOP = 160

log = logging.getLogger("crn")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--clean-dir", required=True)
    p.add_argument("--noise-dir", required=True)
    p.add_argument("--val-dir", required=True, help="contains noisy/ and clean/ with matching names")
    p.add_argument("--out-dir", default="exp/crn")
    p.add_argument("--resume", default="", help="path to a last.pt to continue from")
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--segment", type=float, default=4.0)
    p.add_argument("--snr", type=float, nargs=2, default=[-5.0, 20.0])
    p.add_argument("--num-workers", type=int, default=6)
    p.add_argument("--val-every", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def read_crop(path, length):
    n = sf.info(path).frames
    if n <= length:
        wav, _ = sf.read(path, dtype="float32", always_2d=True)
        wav = wav[:, 0]
        return np.tile(wav, math.ceil(length / max(n, 1)))[:length]
    start = random.randint(0, n - length)
    wav, _ = sf.read(path, start=start, frames=length, dtype="float32", always_2d=True)
    return wav[:, 0]


class OnTheFlyMix(Dataset):
    def __init__(self, clean_files, noise_files, segment, snr_range):
        self.clean_files = clean_files
        self.noise_files = noise_files
        self.seg = int(segment * SR)
        self.snr_range = snr_range

    def __len__(self):
        return len(self.clean_files)

    def __getitem__(self, idx):
        clean = read_crop(self.clean_files[idx], self.seg)
        noise = read_crop(random.choice(self.noise_files), self.seg)
        snr = random.uniform(*self.snr_range)
        c_rms = np.sqrt(np.mean(clean ** 2) + 1e-8)
        n_rms = np.sqrt(np.mean(noise ** 2) + 1e-8)
        noise = noise * (c_rms / n_rms) * 10 ** (-snr / 20)
        noisy = clean + noise
        peak = np.abs(noisy).max()
        if peak > 0.99:
            noisy, clean = noisy * 0.99 / peak, clean * 0.99 / peak
        return torch.from_numpy(noisy.astype(np.float32)), torch.from_numpy(clean.astype(np.float32))


class CRN(nn.Module):
    def __init__(self, channels=(16, 32, 64, 128, 256), n_freq=N_FFT // 2 + 1, hidden=1024):
        super().__init__()
        self.enc = nn.ModuleList()
        cin = 1
        f = n_freq
        for c in channels:
            self.enc.append(nn.Sequential(nn.Conv2d(cin, c, (1, 3), (1, 2)), nn.BatchNorm2d(c), nn.ELU()))
            cin = c
            f = (f - 3) // 2 + 1
        self.lstm = nn.LSTM(cin * f, hidden, num_layers=2, batch_first=True)
        self.proj = nn.Linear(hidden, cin * f)
        self.dec = nn.ModuleList()
        rev = list(channels[::-1])
        for i, c in enumerate(rev):
            cout = rev[i + 1] if i + 1 < len(rev) else 1
            act = [nn.BatchNorm2d(cout), nn.ELU()] if cout != 1 else []
            self.dec.append(nn.Sequential(nn.ConvTranspose2d(c * 2, cout, (1, 3), (1, 2)), *act))

    def forward(self, mag):
        # mag: (B, F, T) -> mask (B, F, T)
        x = mag.transpose(1, 2).unsqueeze(1)  # B,1,T,F
        skips = []
        for layer in self.enc:
            x = layer(x)
            skips.append(x)
        b, c, t, f = x.shape
        h, _ = self.lstm(x.permute(0, 2, 1, 3).reshape(b, t, c * f))
        x = self.proj(h).reshape(b, t, c, f).permute(0, 2, 1, 3)
        for layer in self.dec:
            skip = skips.pop()
            x = layer(torch.cat([x, skip], dim=1))
            if skips:
                x = F.pad(x, (0, skips[-1].shape[-1] - x.shape[-1]))
        x = F.pad(x, (0, mag.shape[1] - x.shape[-1]))
        return torch.sigmoid(x.squeeze(1)).transpose(1, 2)


def enhance(model, noisy, window):
    spec = torch.stft(noisy, N_FFT, HOP, N_FFT, window=window, return_complex=True)
    mask = model(spec.abs())
    return torch.istft(spec * mask, N_FFT, HOP, N_FFT, window=window, length=noisy.shape[-1])


def spec_loss(est, ref, window):
    e = torch.stft(est, N_FFT, HOP, N_FFT, window=window, return_complex=True).abs()
    r = torch.stft(ref, N_FFT, HOP, N_FFT, window=window, return_complex=True).abs()
    # power-law compressed magnitude MSE + a small waveform term
    return F.mse_loss(e.clamp_min(1e-8) ** 0.3, r.clamp_min(1e-8) ** 0.3) + 0.1 * F.l1_loss(est, ref)


@torch.no_grad()
def validate(net, files, val_dir, window, device):
    net.eval()
    totals = torch.zeros(4, device=device)  # loss, pesq, stoi, count
    for name in files:
        noisy, _ = sf.read(os.path.join(val_dir, "noisy", name), dtype="float32")
        clean, _ = sf.read(os.path.join(val_dir, "clean", name), dtype="float32")
        x = torch.from_numpy(noisy).to(device)[None]
        y = torch.from_numpy(clean).to(device)[None]
        est = enhance(net, x, window)
        totals[0] += spec_loss(est, y, window)
        e = est[0].cpu().numpy()
        try:
            totals[1] += pesq(SR, clean, e, "wb")
        except Exception:
            totals[1] += 1.0
        totals[2] += stoi(clean, e, SR, extended=False)
        totals[3] += 1
    dist.all_reduce(totals)
    net.train()
    n = totals[3].item()
    return totals[0].item() / n, totals[1].item() / n, totals[2].item() / n


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)
    os.makedirs(args.out_dir, exist_ok=True)

    clean_files = sorted(glob.glob(os.path.join(args.clean_dir, "**", "*.wav"), recursive=True))
    noise_files = sorted(glob.glob(os.path.join(args.noise_dir, "**", "*.wav"), recursive=True))
    val_files = sorted(os.listdir(os.path.join(args.val_dir, "noisy")))
    my_val = val_files[rank::world]

    train_set = OnTheFlyMix(clean_files, noise_files, args.segment, args.snr)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.num_workers, pin_memory=True, drop_last=True,
                        persistent_workers=True)

    model = CRN()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=3)
    window = torch.hann_window(N_FFT, device=device)

    start_epoch, best_pesq = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_pesq = ckpt["epoch"] + 1, ckpt["best_pesq"]
        log.info("resumed from %s at epoch %d", args.resume, start_epoch)

    ddp = DDP(model, device_ids=[local_rank], output_device=local_rank)
    log.info("%d clean files, %d noise files, world size %d", len(clean_files), len(noise_files), world)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0, running = time.time(), 0.0
        for step, (noisy, clean) in enumerate(loader):
            noisy = noisy.to(device, non_blocking=True)
            clean = clean.to(device, non_blocking=True)
            est = enhance(ddp, noisy, window)
            loss = spec_loss(est, clean, window)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 5.0)
            optimizer.step()
            running += loss.item()
            if step % 100 == 0:
                log.info("epoch %d step %d loss %.4f", epoch, step, loss.item())
        log.info("epoch %d done in %.0fs, mean loss %.4f", epoch, time.time() - t0, running / max(step + 1, 1))

        if (epoch + 1) % args.val_every == 0:
            vloss, vpesq, vstoi = validate(model, my_val, args.val_dir, window, device)
            scheduler.step(vpesq)
            log.info("val epoch %d: loss %.4f PESQ %.3f STOI %.4f", epoch, vloss, vpesq, vstoi)
            if rank == 0:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "epoch": epoch, "best_pesq": max(best_pesq, vpesq)}
                torch.save(state, os.path.join(args.out_dir, "last.pt"))
                if vpesq > best_pesq:
                    torch.save(state, os.path.join(args.out_dir, "best.pt"))
            best_pesq = max(best_pesq, vpesq)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
