# FullSubNet-lite: full-band + sub-band LSTM fusion, predicts a compressed cIRM.
#
# torchrun --nproc_per_node=4 06_fullsubnet_lite.py \
#     --train-json data/dns_train.json --valid-json data/dns_valid.json
#
# train json: {"clean": [...], "noise": [...], "rir": [...]}   (rir optional)
# valid json: [{"noisy": ..., "clean": ...}, ...]
import argparse
import json
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
from scipy.signal import fftconvolve
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SR, N_FFT, HOP = 16000, 512, 256
K_CRM, C_CRM = 10.0, 0.1


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-json", required=True)
    p.add_argument("--valid-json", required=True)
    p.add_argument("--save-dir", default="runs/fullsubnet_lite")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--sub-neighbors", type=int, default=15)
    p.add_argument("--reverb-prob", type=float, default=0.25)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class DNSTrain(Dataset):
    def __init__(self, meta, seconds=3.072, snr=(-5, 20), reverb_prob=0.25):
        self.clean, self.noise, self.rir = meta["clean"], meta["noise"], meta.get("rir", [])
        self.n = int(seconds * SR)
        self.snr = snr
        self.reverb_prob = reverb_prob if self.rir else 0.0

    def __len__(self):
        return len(self.clean)

    def _crop(self, path):
        x, _ = sf.read(path, dtype="float32", always_2d=True)
        x = x[:, 0]
        if len(x) < self.n:
            x = np.pad(x, (0, self.n - len(x)), mode="wrap")
        o = random.randint(0, len(x) - self.n)
        return x[o:o + self.n]

    def __getitem__(self, i):
        clean = self._crop(self.clean[i])
        if random.random() < self.reverb_prob:
            rir, _ = sf.read(random.choice(self.rir), dtype="float32", always_2d=True)
            clean = fftconvolve(clean, rir[:, 0])[: self.n].astype(np.float32)
        noise = self._crop(random.choice(self.noise))
        snr = random.uniform(*self.snr)
        noise = noise / (np.linalg.norm(noise) + 1e-7) * np.linalg.norm(clean) / 10 ** (snr / 20)
        noisy = clean + noise
        g = 10 ** (random.uniform(-35, -15) / 20) / (np.sqrt(np.mean(noisy ** 2)) + 1e-7)
        return (noisy * g).astype(np.float32), (clean * g).astype(np.float32)


class FullSubNetLite(nn.Module):
    def __init__(self, n_freq=N_FFT // 2 + 1, neighbors=15, fb_hidden=512, sb_hidden=384):
        super().__init__()
        self.neighbors = neighbors
        self.fb_lstm = nn.LSTM(n_freq, fb_hidden, num_layers=2, batch_first=True)
        self.fb_out = nn.Linear(fb_hidden, n_freq)
        self.sb_lstm = nn.LSTM(2 * neighbors + 1 + 1, sb_hidden, num_layers=2, batch_first=True)
        self.sb_out = nn.Linear(sb_hidden, 2)

    @staticmethod
    def norm(x):
        return x / (x.mean(dim=(1, 2), keepdim=True) + 1e-5)

    def forward(self, mag):
        # mag: (B, F, T)
        B, Fq, T = mag.shape
        fb = torch.relu(self.fb_out(self.fb_lstm(self.norm(mag).transpose(1, 2))[0]))  # B,T,F
        fb = fb.transpose(1, 2)                                                        # B,F,T
        padded = F.pad(mag.unsqueeze(1), (0, 0, self.neighbors, self.neighbors), mode="reflect").squeeze(1)
        units = padded.unfold(1, 2 * self.neighbors + 1, 1)                            # B,F,T,2N+1
        x = torch.cat([units, fb.unsqueeze(-1)], -1).reshape(B * Fq, T, -1)
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        crm = self.sb_out(self.sb_lstm(x)[0])                                          # B*F,T,2
        return crm.reshape(B, Fq, T, 2)


def compress_crm(noisy, clean):
    denom = noisy.real ** 2 + noisy.imag ** 2 + 1e-8
    re = (noisy.real * clean.real + noisy.imag * clean.imag) / denom
    im = (noisy.real * clean.imag - noisy.imag * clean.real) / denom
    m = torch.stack([re, im], -1)
    return K_CRM * (1 - torch.exp(-C_CRM * m)) / (1 + torch.exp(-C_CRM * m))


def decompress_crm(m, lim=9.9):
    m = m.clamp(-lim, lim)
    return -1 / C_CRM * torch.log((K_CRM - m) / (K_CRM + m))


def apply_crm(noisy_spec, crm):
    re = crm[..., 0] * noisy_spec.real - crm[..., 1] * noisy_spec.imag
    im = crm[..., 1] * noisy_spec.real + crm[..., 0] * noisy_spec.imag
    return torch.complex(re, im)


@torch.no_grad()
def validate(net, items, window, device):
    net.eval()
    tot = torch.zeros(3, device=device)
    for it in items:
        noisy, _ = sf.read(it["noisy"], dtype="float32")
        clean, _ = sf.read(it["clean"], dtype="float32")
        x = torch.from_numpy(noisy).to(device)[None]
        spec = torch.stft(x, N_FFT, HOP, window=window, return_complex=True)
        crm = decompress_crm(net(spec.abs()))
        est = torch.istft(apply_crm(spec, crm), N_FFT, HOP, window=window, length=x.shape[-1])[0].cpu().numpy()
        tot += torch.tensor([pesq(SR, clean, est, "wb"), stoi(clean, est, SR), 1.0], device=device)
    dist.all_reduce(tot)
    net.train()
    return (tot[:2] / tot[2]).tolist()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1000 + rank)
    torch.manual_seed(1000)

    with open(args.train_json) as f:
        meta = json.load(f)
    with open(args.valid_json) as f:
        valid_items = json.load(f)

    train_set = DNSTrain(meta, reverb_prob=args.reverb_prob)
    sampler = DistributedSampler(train_set, shuffle=True, seed=1000)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, prefetch_factor=4, persistent_workers=True)

    net = FullSubNetLite(neighbors=args.sub_neighbors).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    window = torch.hann_window(N_FFT, device=device)
    os.makedirs(args.save_dir, exist_ok=True)

    best_score = -1e9
    for epoch in range(args.epochs):
        model.train()
        start, losses = time.time(), []
        for noisy, clean in loader:
            noisy, clean = noisy.to(device, non_blocking=True), clean.to(device, non_blocking=True)
            nspec = torch.stft(noisy, N_FFT, HOP, window=window, return_complex=True)
            cspec = torch.stft(clean, N_FFT, HOP, window=window, return_complex=True)
            target = compress_crm(nspec, cspec)
            pred = model(nspec.abs())
            loss = F.mse_loss(pred, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            losses.append(loss.item())
        if rank == 0:
            print(f"[{epoch:03d}] train loss {np.mean(losses):.5f}  {time.time() - start:.0f}s", flush=True)

        v_pesq, v_stoi = validate(net, valid_items[rank::world], window, device)
        # DNS-style combined score: STOI and PESQ rescaled to [0, 1]
        score = (v_stoi + (v_pesq + 0.5) / 5.0) / 2
        if rank == 0:
            print(f"[{epoch:03d}] valid PESQ {v_pesq:.3f} STOI {v_stoi:.4f} score {score:.4f}", flush=True)
            torch.save({"epoch": epoch, "model": net.state_dict(), "optimizer": opt.state_dict()},
                       os.path.join(args.save_dir, "latest.tar"))
            if score > best_score:
                best_score = score
                torch.save(net.state_dict(), os.path.join(args.save_dir, "best_model.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
