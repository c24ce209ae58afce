"""FullSubNet-style (full-band + sub-band LSTMs, cIRM target) enhancement on DNS data.

torchrun --standalone --nproc_per_node=4 14_fullsubnet_dns.py \
    --train_list lists/dns_train.tsv --test_dir /data/dns/test_set/synthetic/no_reverb
"""
import argparse
import glob
import logging
import os
import random

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

log = logging.getLogger("fullsubnet")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train_list", required=True, help="tsv: noisy_path<TAB>clean_path")
    p.add_argument("--test_dir", required=True)
    p.add_argument("--out_dir", default="exp/fullsubnet")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--sr", type=int, default=16000)
    p.add_argument("--n_fft", type=int, default=512)
    p.add_argument("--hop", type=int, default=256)
    p.add_argument("--segment", type=float, default=3.072)
    p.add_argument("--batch_size", type=int, default=12)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--num_neighbors", type=int, default=15)
    return p.parse_args()


class NoisyCleanList(Dataset):
    def __init__(self, list_file, sr, segment):
        with open(list_file) as f:
            self.pairs = [line.rstrip("\n").split("\t") for line in f if line.strip()]
        self.seg = int(sr * segment)

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        noisy_path, clean_path = self.pairs[i]
        n = sf.info(noisy_path).frames
        start = random.randint(0, max(0, n - self.seg))
        noisy = sf.read(noisy_path, start=start, frames=self.seg, dtype="float32", fill_value=0.0)[0]
        clean = sf.read(clean_path, start=start, frames=self.seg, dtype="float32", fill_value=0.0)[0]
        return torch.from_numpy(noisy), torch.from_numpy(clean)


class STFT(nn.Module):
    def __init__(self, n_fft, hop):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("window", torch.hann_window(n_fft))

    def stft(self, wav):
        return torch.stft(wav, self.n_fft, self.hop, window=self.window, return_complex=True)

    def istft(self, spec, length):
        return torch.istft(spec, self.n_fft, self.hop, window=self.window, length=length)


class FullSubNet(nn.Module):
    def __init__(self, n_freq=257, num_neighbors=15, fb_hidden=512, sb_hidden=384):
        super().__init__()
        self.nn = num_neighbors
        self.fb_lstm = nn.LSTM(n_freq, fb_hidden, num_layers=2, batch_first=True)
        self.fb_out = nn.Linear(fb_hidden, n_freq)
        self.sb_lstm = nn.LSTM(2 * num_neighbors + 2, sb_hidden, num_layers=2, batch_first=True)
        self.sb_out = nn.Linear(sb_hidden, 2)

    def forward(self, mag):  # B, F, T
        B, Fq, T = mag.shape
        mag = mag / (mag.mean(dim=(1, 2), keepdim=True) + 1e-5)
        fb, _ = self.fb_lstm(mag.transpose(1, 2))
        fb = F.relu(self.fb_out(fb)).transpose(1, 2)  # B, F, T
        padded = F.pad(mag.transpose(1, 2), (self.nn, self.nn), mode="reflect").transpose(1, 2)
        neigh = padded.unfold(1, 2 * self.nn + 1, 1)  # B, F, T, 2n+1
        sb_in = torch.cat([neigh, fb.unsqueeze(-1)], dim=-1).reshape(B * Fq, T, -1)
        sb, _ = self.sb_lstm(sb_in)
        return self.sb_out(sb).reshape(B, Fq, T, 2)


def compress_cirm(noisy, clean, K=10.0, C=0.1):
    denom = noisy.real ** 2 + noisy.imag ** 2 + 1e-8
    mr = (noisy.real * clean.real + noisy.imag * clean.imag) / denom
    mi = (noisy.real * clean.imag - noisy.imag * clean.real) / denom
    m = torch.stack([mr, mi], dim=-1)
    return K * (1 - torch.exp(-C * m)) / (1 + torch.exp(-C * m))


def decompress_cirm(m, K=10.0, limit=9.99):
    m = m.clamp(-limit, limit)
    return -K * torch.log((K - m) / (K + m))


def enhance(model, stft, noisy):
    spec = stft.stft(noisy)
    m = decompress_cirm(model(spec.abs()))
    est = torch.complex(m[..., 0] * spec.real - m[..., 1] * spec.imag, m[..., 0] * spec.imag + m[..., 1] * spec.real)
    return stft.istft(est, noisy.size(-1))


@torch.no_grad()
def evaluate(model, stft, test_dir, sr, device, rank, world):
    model.eval()
    noisy_files = sorted(glob.glob(os.path.join(test_dir, "noisy", "*.wav")))
    acc = torch.zeros(4, device=device, dtype=torch.float64)
    for path in noisy_files[rank::world]:
        fid = path.rsplit("fileid_", 1)[1]
        noisy, _ = sf.read(path, dtype="float32")
        clean, _ = sf.read(os.path.join(test_dir, "clean", f"clean_fileid_{fid}"), dtype="float32")
        enh = enhance(model, stft, torch.from_numpy(noisy).to(device)[None])[0].cpu().numpy()
        acc[0] += pesq(sr, clean, enh, "wb")
        acc[1] += pesq(sr, clean, enh, "nb")
        acc[2] += stoi(clean, enh, sr)
        acc[3] += 1
    dist.all_reduce(acc)
    model.train()
    return {"pesq_wb": (acc[0] / acc[3]).item(), "pesq_nb": (acc[1] / acc[3]).item(), "stoi": (acc[2] / acc[3]).item()}


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")

    dataset = NoisyCleanList(args.train_list, args.sr, args.segment)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, prefetch_factor=4)

    stft = STFT(args.n_fft, args.hop).to(args.device)
    model = FullSubNet(n_freq=args.n_fft // 2 + 1, num_neighbors=args.num_neighbors).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    warmup_steps = 1000
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup_steps))

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(2, device=device)
        for noisy, clean in loader:
            noisy = noisy.to(device, non_blocking=True)
            clean = clean.to(device, non_blocking=True)
            noisy_spec, clean_spec = stft.stft(noisy), stft.stft(clean)
            target = compress_cirm(noisy_spec, clean_spec)
            pred = model(noisy_spec.abs())
            loss = F.mse_loss(pred, target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            sched.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)
        scores = evaluate(model.module, stft, args.test_dir, args.sr, device, rank, world)
        log.info("epoch %d loss %.4f | PESQ-WB %.3f PESQ-NB %.3f STOI %.4f", epoch,
                 (running[0] / running[1]).item(), scores["pesq_wb"], scores["pesq_nb"], scores["stoi"])
        if rank == 0:
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                       os.path.join(args.out_dir, "latest.tar"))
            if scores["pesq_wb"] > best:
                best = scores["pesq_wb"]
                torch.save(model.module.state_dict(), os.path.join(args.out_dir, "best_model.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
