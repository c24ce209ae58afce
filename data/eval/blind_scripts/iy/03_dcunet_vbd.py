"""DCUNet-style complex-spectrum U-Net for VoiceBank+DEMAND.

Training mixtures: VCTK clean utterances + DEMAND noise, mixed at a random SNR
each time a sample is drawn. Validation: the official noisy test set, enhanced
on full utterances (long files are processed in overlapping chunks).

    torchrun --nnodes=1 --nproc_per_node=4 03_dcunet_vbd.py --data /datasets/vbd
"""
import argparse
import os
import random
from glob import glob

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from pesq import pesq
from pystoi import stoi
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

SR = 16000


class MixDataset(Dataset):
    def __init__(self, clean_paths, noise_paths, seg_len=32000, snrs=(0, 5, 10, 15)):
        self.clean_paths = clean_paths
        self.noise = [torchaudio.load(p)[0][0] for p in noise_paths]  # DEMAND is small, keep it in RAM
        self.seg_len = seg_len
        self.snrs = snrs

    def __len__(self):
        return len(self.clean_paths)

    def __getitem__(self, i):
        clean, sr = torchaudio.load(self.clean_paths[i])
        clean = clean[0]
        if sr != SR:
            clean = torchaudio.functional.resample(clean, sr, SR)
        if clean.numel() < self.seg_len:
            clean = F.pad(clean, (0, self.seg_len - clean.numel()))
        st = random.randint(0, clean.numel() - self.seg_len)
        clean = clean[st:st + self.seg_len]
        noise = random.choice(self.noise)
        ns = random.randint(0, noise.numel() - self.seg_len)
        noise = noise[ns:ns + self.seg_len]
        snr = torch.tensor([random.choice(self.snrs) + random.uniform(-2.5, 2.5)])
        noisy = torchaudio.functional.add_noise(clean[None], noise[None], snr)[0]
        return noisy, clean


class EncBlock(nn.Module):
    def __init__(self, cin, cout, k, s, p):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, s, p)
        self.norm = nn.GroupNorm(4, cout)

    def forward(self, x):
        return F.leaky_relu(self.norm(self.conv(x)), 0.1)


class DecBlock(nn.Module):
    def __init__(self, cin, cout, k, s, p, last=False):
        super().__init__()
        self.conv = nn.ConvTranspose2d(cin, cout, k, s, p, output_padding=(1, 0))
        self.norm = None if last else nn.GroupNorm(4, cout)

    def forward(self, x):
        x = self.conv(x)
        return x if self.norm is None else F.leaky_relu(self.norm(x), 0.1)


class DCUNet(nn.Module):
    def __init__(self, n_fft=1024, hop=256):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        ch = [2, 32, 64, 64, 64, 64]
        self.enc = nn.ModuleList([EncBlock(ch[i], ch[i + 1], (5, 3), (2, 1), (2, 1)) for i in range(5)])
        self.dec = nn.ModuleList()
        for i in range(5, 0, -1):
            cin = ch[i] if i == 5 else ch[i] * 2
            self.dec.append(DecBlock(cin, ch[i - 1] if i > 1 else 2, (5, 3), (2, 1), (2, 1), last=(i == 1)))

    def stft(self, wav):
        return torch.stft(wav, self.n_fft, self.hop, window=self.window, return_complex=True)

    def istft(self, spec, length):
        return torch.istft(spec, self.n_fft, self.hop, window=self.window, length=length)

    def forward(self, wav):
        spec = self.stft(wav)                                  # B, F, T complex
        x = torch.stack([spec.real, spec.imag], 1)[:, :, :-1]  # drop Nyquist: F = 512
        skips = []
        for e in self.enc:
            x = e(x)
            skips.append(x)
        skips.pop()
        for j, d in enumerate(self.dec):
            if j > 0:
                s = skips.pop()
                x = torch.cat([x[..., :s.shape[-2], :s.shape[-1]], s], 1)
            x = d(x)
        x = F.pad(x[..., :spec.shape[-2] - 1, :spec.shape[-1]], (0, 0, 0, 1))
        mask = torch.complex(x[:, 0], x[:, 1])
        # bounded complex ratio mask (tanh on magnitude, keep the phase)
        mag = mask.abs()
        mask = torch.tanh(mag) * mask / (mag + 1e-8)
        return self.istft(spec * mask, wav.shape[-1])

    @torch.no_grad()
    def enhance_chunked(self, wav, chunk=SR * 8, overlap=SR):
        """Enhance an arbitrarily long 1-D waveform with linear cross-fades between chunks."""
        T = wav.numel()
        if T <= chunk:
            return self(wav[None])[0]
        step = chunk - overlap
        out = torch.zeros(T, device=wav.device)
        weight = torch.zeros(T, device=wav.device)
        fade = torch.ones(chunk, device=wav.device)
        ramp = torch.linspace(0, 1, overlap, device=wav.device)
        fade[:overlap], fade[-overlap:] = ramp, ramp.flip(0)
        for st in range(0, T, step):
            seg = wav[st:st + chunk]
            n = seg.numel()
            y = self(F.pad(seg, (0, chunk - n))[None])[0][:n]
            out[st:st + n] += y * fade[:n]
            weight[st:st + n] += fade[:n]
            if st + chunk >= T:
                break
        return out / weight.clamp_min(1e-4)


def wsdr_loss(noisy, est, clean, eps=1e-8):
    def neg_sdr(a, b):
        return -(a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1) + eps)
    noise, est_noise = noisy - clean, noisy - est
    alpha = clean.pow(2).sum(-1) / (clean.pow(2).sum(-1) + noise.pow(2).sum(-1) + eps)
    return (alpha * neg_sdr(clean, est) + (1 - alpha) * neg_sdr(noise, est_noise)).mean()


@torch.no_grad()
def validate(model, pairs, device):
    model.eval()
    acc = torch.zeros(3, device=device)
    for noisy_path, clean_path in pairs:
        noisy = torchaudio.load(noisy_path)[0][0].to(device)
        clean = torchaudio.load(clean_path)[0][0]
        est = model.enhance_chunked(noisy).cpu()
        acc[0] += pesq(SR, clean.numpy(), est.numpy(), "wb")
        acc[1] += stoi(clean.numpy(), est.numpy(), SR, extended=False)
        acc[2] += 1
    dist.all_reduce(acc, op=dist.ReduceOp.SUM)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--exp", default="exp/dcunet_vbd")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--bs", type=int, default=12)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2023)
    random.seed(2023 + rank)

    clean = sorted(glob(os.path.join(args.data, "clean_trainset_28spk_wav_16k", "*.wav")))
    noise = sorted(glob(os.path.join(args.data, "demand_16k", "*", "*.wav")))
    test_noisy = sorted(glob(os.path.join(args.data, "noisy_testset_wav_16k", "*.wav")))
    test_pairs = [(p, p.replace("noisy_testset", "clean_testset")) for p in test_noisy]

    train_ds = MixDataset(clean, noise)
    sampler = DistributedSampler(train_ds)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    model = DCUNet().to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    writer = SummaryWriter(args.exp) if rank == 0 else None
    os.makedirs(args.exp, exist_ok=True)

    best, gstep = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for noisy, clean in loader:
            noisy, clean = noisy.to(device), clean.to(device)
            est = model(noisy)
            loss = wsdr_loss(noisy, est, clean)
            opt.zero_grad()
            loss.backward()
            opt.step()
            gstep += 1
            if writer is not None and gstep % 50 == 0:
                writer.add_scalar("train/wsdr", loss.item(), gstep)

        val_pesq, val_stoi = validate(model, test_pairs[rank::world], device)
        if rank == 0:
            writer.add_scalar("val/pesq", val_pesq, epoch)
            writer.add_scalar("val/stoi", val_stoi, epoch)
            print(f"epoch {epoch}: PESQ {val_pesq:.3f} STOI {val_stoi:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.exp, "last.pt"))
            if val_pesq > best:
                best = val_pesq
                torch.save(model.module.state_dict(), os.path.join(args.exp, "best_model.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
