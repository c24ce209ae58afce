"""MelGAN generator + multi-resolution spectrogram discriminator, LSGAN + feature matching + MR-STFT.

torchrun --nproc_per_node=4 05_melgan_multiscale.py --data_root /data/LJSpeech-1.1 --exp exp/melgan_mrd
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
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import weight_norm
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


# ----------------------------------------------------------------------------- data
class WavSegments(Dataset):
    def __init__(self, root, filelist, segment=8192, sr=22050):
        with open(filelist) as f:
            self.files = [os.path.join(root, "wavs", l.split("|")[0] + ".wav") for l in f if l.strip()]
        self.segment, self.sr = segment, sr

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        wav, sr = sf.read(self.files[i], dtype="float32")
        assert sr == self.sr, self.files[i]
        wav = torch.from_numpy(wav) * 0.95 / (np.abs(wav).max() + 1e-6)
        if wav.numel() >= self.segment:
            start = random.randint(0, wav.numel() - self.segment)
            wav = wav[start:start + self.segment]
        else:
            wav = F.pad(wav, (0, self.segment - wav.numel()))
        return wav.unsqueeze(0)


class LogMel(nn.Module):
    def __init__(self, sr=22050, n_fft=1024, hop=256, n_mels=80):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(sr, n_fft=n_fft, hop_length=hop, n_mels=n_mels,
                                                        f_min=0.0, f_max=8000.0, power=1.0, center=False)
        self.pad = (n_fft - hop) // 2

    def forward(self, wav):
        wav = F.pad(wav, (self.pad, self.pad), mode="reflect")
        return torch.log(torch.clamp(self.mel(wav.squeeze(1)), min=1e-5))


# ----------------------------------------------------------------------------- models
class ResStack(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.LeakyReLU(0.2), nn.ReflectionPad1d(3 ** i),
                          weight_norm(nn.Conv1d(ch, ch, 3, dilation=3 ** i)),
                          nn.LeakyReLU(0.2), weight_norm(nn.Conv1d(ch, ch, 1)))
            for i in range(3)])

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


class MelGANGenerator(nn.Module):
    def __init__(self, n_mels=80, ngf=32, ratios=(8, 8, 2, 2)):
        super().__init__()
        mult = 2 ** len(ratios)
        layers = [nn.ReflectionPad1d(3), weight_norm(nn.Conv1d(n_mels, mult * ngf, 7))]
        for r in ratios:
            layers += [nn.LeakyReLU(0.2),
                       weight_norm(nn.ConvTranspose1d(mult * ngf, mult * ngf // 2, r * 2, stride=r,
                                                      padding=r // 2 + r % 2, output_padding=r % 2)),
                       ResStack(mult * ngf // 2)]
            mult //= 2
        layers += [nn.LeakyReLU(0.2), nn.ReflectionPad1d(3), weight_norm(nn.Conv1d(ngf, 1, 7)), nn.Tanh()]
        self.net = nn.Sequential(*layers)

    def forward(self, mel):
        return self.net(mel)


class SpecDiscriminator(nn.Module):
    """2-D conv discriminator on a log-magnitude STFT of one resolution."""

    def __init__(self, n_fft, hop, win):
        super().__init__()
        self.n_fft, self.hop, self.win = n_fft, hop, win
        self.register_buffer("window", torch.hann_window(win), persistent=False)
        chans = [1, 32, 64, 128, 128]
        self.convs = nn.ModuleList([
            nn.Sequential(nn.Conv2d(chans[i], chans[i + 1], (3, 9), stride=(1, 2), padding=(1, 4)),
                          nn.BatchNorm2d(chans[i + 1]), nn.LeakyReLU(0.2))
            for i in range(len(chans) - 1)])
        self.out = nn.Conv2d(chans[-1], 1, 3, padding=1)

    def forward(self, y):
        spec = torch.stft(y.squeeze(1), self.n_fft, self.hop, self.win, self.window, return_complex=True)
        x = torch.log1p(spec.abs()).unsqueeze(1)
        fmap = []
        for c in self.convs:
            x = c(x)
            fmap.append(x)
        x = self.out(x)
        fmap.append(x)
        return x.flatten(1), fmap


class MultiResolutionDiscriminator(nn.Module):
    def __init__(self, resolutions=((1024, 120, 600), (2048, 240, 1200), (512, 50, 240))):
        super().__init__()
        self.discs = nn.ModuleList([SpecDiscriminator(*r) for r in resolutions])

    def forward(self, y):
        return [d(y) for d in self.discs]


def stft_mag(x, n_fft, hop, win):
    window = torch.hann_window(win, device=x.device)
    return torch.stft(x.squeeze(1), n_fft, hop, win, window, return_complex=True).abs().clamp(min=1e-7)


def mr_stft_loss(y_hat, y, resolutions=((1024, 120, 600), (2048, 240, 1200), (512, 50, 240))):
    sc, mag = 0.0, 0.0
    for r in resolutions:
        m_hat, m = stft_mag(y_hat, *r), stft_mag(y, *r)
        sc = sc + torch.norm(m - m_hat, p="fro") / torch.norm(m, p="fro")
        mag = mag + F.l1_loss(torch.log(m), torch.log(m_hat))
    return (sc + mag) / len(resolutions)


# ----------------------------------------------------------------------------- train
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_root", required=True)
    ap.add_argument("--exp", default="exp/melgan_mrd")
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=3000)
    ap.add_argument("--disc_start", type=int, default=100000)
    ap.add_argument("--lambda_fm", type=float, default=10.0)
    ap.add_argument("--save_every", type=int, default=10000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)
    random.seed(1234 + rank)

    dataset = WavSegments(args.data_root, os.path.join(args.data_root, "train.txt"))
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    to_mel = LogMel().to(device)
    G = DDP(MelGANGenerator().to(device), device_ids=[local_rank])
    D = DDP(MultiResolutionDiscriminator().to(device), device_ids=[local_rank])
    opt_g = torch.optim.Adam(G.parameters(), lr=args.lr, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(D.parameters(), lr=args.lr, betas=(0.5, 0.9))

    writer = None
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
        writer = SummaryWriter(args.exp)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for wav in loader:
            wav = wav.to(device, non_blocking=True)
            mel = to_mel(wav)
            wav_hat = G(mel)[..., :wav.size(-1)]

            loss_d = torch.zeros((), device=device)
            if step >= args.disc_start:
                real_out = D(wav)
                fake_out = D(wav_hat.detach())
                for (r, _), (f, _) in zip(real_out, fake_out):
                    loss_d = loss_d + torch.mean((r - 1) ** 2) + torch.mean(f ** 2)
                opt_d.zero_grad(set_to_none=True)
                loss_d.backward()
                opt_d.step()

            loss_stft = mr_stft_loss(wav_hat, wav)
            loss_adv = torch.zeros((), device=device)
            loss_fm = torch.zeros((), device=device)
            if step >= args.disc_start:
                fake_out = D(wav_hat)
                with torch.no_grad():
                    real_out = D(wav)
                for (f, fmap_f), (_, fmap_r) in zip(fake_out, real_out):
                    loss_adv = loss_adv + torch.mean((f - 1) ** 2)
                    for a, b in zip(fmap_f, fmap_r):
                        loss_fm = loss_fm + F.l1_loss(a, b.detach())
            loss_g = loss_stft + 4.0 * loss_adv + args.lambda_fm * loss_fm
            opt_g.zero_grad(set_to_none=True)
            loss_g.backward()
            opt_g.step()

            if rank == 0 and step % 100 == 0:
                writer.add_scalar("loss/d", loss_d.item(), step)
                writer.add_scalar("loss/stft", loss_stft.item(), step)
                writer.add_scalar("loss/adv", loss_adv.item(), step)
                writer.add_scalar("loss/fm", loss_fm.item(), step)
                print(f"[{epoch}:{step}] d={loss_d.item():.3f} stft={loss_stft.item():.3f} "
                      f"adv={loss_adv.item():.3f} fm={loss_fm.item():.3f}", flush=True)
            if rank == 0 and step % args.save_every == 0 and step > 0:
                torch.save({"G": G.module.state_dict(), "D": D.module.state_dict(),
                            "opt_g": opt_g.state_dict(), "opt_d": opt_d.state_dict(), "step": step},
                           os.path.join(args.exp, f"ckpt_{step:08d}.pt"))
                with torch.no_grad():
                    G.module.eval()
                    sample = G.module(mel[:1])
                    G.module.train()
                writer.add_audio("gen", sample[0].cpu(), step, 22050)
                writer.add_audio("gt", wav[0].cpu(), step, 22050)
            step += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
