"""GAN vocoder: HiFi-GAN-style generator, multi-period discriminator + multi-resolution STFT loss.

Single node, all visible GPUs:
    python 08_vocoder_mrstft_spawn.py -c configs/vocoder_22k.yaml
"""
import argparse
import glob
import os
import random
import socket
from contextlib import closing

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import weight_norm
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def free_port():
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class MelWavDataset(Dataset):
    """Pairs of precomputed mels (.npy, [n_mels, T]) and wavs, cropped to a fixed number of frames."""

    def __init__(self, root, hop, frames):
        self.mels = sorted(glob.glob(os.path.join(root, "mels", "*.npy")))
        self.root, self.hop, self.frames = root, hop, frames

    def __len__(self):
        return len(self.mels)

    def __getitem__(self, i):
        mel = torch.from_numpy(np.load(self.mels[i]))
        name = os.path.splitext(os.path.basename(self.mels[i]))[0]
        wav, _ = torchaudio.load(os.path.join(self.root, "wavs", name + ".wav"))
        wav = wav[0]
        if mel.size(1) <= self.frames:
            mel = F.pad(mel, (0, self.frames - mel.size(1) + 1), value=-11.5)
        start = random.randint(0, mel.size(1) - self.frames)
        mel = mel[:, start:start + self.frames]
        wav = wav[start * self.hop:(start + self.frames) * self.hop]
        wav = F.pad(wav, (0, self.frames * self.hop - wav.numel()))
        return mel, wav.unsqueeze(0)


class ResStack(nn.Module):
    def __init__(self, ch, k=3, dilations=(1, 3, 5)):
        super().__init__()
        self.layers = nn.ModuleList([
            nn.Sequential(nn.LeakyReLU(0.1), weight_norm(nn.Conv1d(ch, ch, k, dilation=d, padding=d * (k - 1) // 2)),
                          nn.LeakyReLU(0.1), weight_norm(nn.Conv1d(ch, ch, k, padding=(k - 1) // 2)))
            for d in dilations])

    def forward(self, x):
        for l in self.layers:
            x = x + l(x)
        return x


class Generator(nn.Module):
    def __init__(self, n_mels, ch, rates):
        super().__init__()
        self.pre = weight_norm(nn.Conv1d(n_mels, ch, 7, padding=3))
        ups = []
        for r in rates:
            ups += [nn.LeakyReLU(0.1), weight_norm(nn.ConvTranspose1d(ch, ch // 2, 2 * r, r, padding=r // 2 + r % 2,
                                                                      output_padding=r % 2)),
                    ResStack(ch // 2)]
            ch //= 2
        self.body = nn.Sequential(*ups)
        self.post = nn.Sequential(nn.LeakyReLU(0.1), weight_norm(nn.Conv1d(ch, 1, 7, padding=3)), nn.Tanh())

    def forward(self, mel):
        return self.post(self.body(self.pre(mel)))


class PeriodDisc(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p
        ch = [1, 32, 128, 512, 1024, 1024]
        self.convs = nn.ModuleList([weight_norm(nn.Conv2d(ch[i], ch[i + 1], (5, 1), (3, 1) if i < 4 else 1, (2, 0)))
                                    for i in range(5)])
        self.out = weight_norm(nn.Conv2d(1024, 1, (3, 1), 1, (1, 0)))

    def forward(self, x):
        b, c, t = x.shape
        if t % self.p:
            x = F.pad(x, (0, self.p - t % self.p), "reflect")
        x = x.view(b, c, -1, self.p)
        feats = []
        for conv in self.convs:
            x = F.leaky_relu(conv(x), 0.1)
            feats.append(x)
        return self.out(x).flatten(1), feats


class MPD(nn.Module):
    def __init__(self, periods=(2, 3, 5, 7, 11)):
        super().__init__()
        self.discs = nn.ModuleList([PeriodDisc(p) for p in periods])

    def forward(self, x):
        return [d(x) for d in self.discs]


class MultiResSTFTLoss(nn.Module):
    def __init__(self, resolutions=((1024, 120, 600), (2048, 240, 1200), (512, 50, 240))):
        super().__init__()
        self.resolutions = resolutions

    def forward(self, y_hat, y):
        sc, mag = 0.0, 0.0
        for n_fft, hop, win in self.resolutions:
            w = torch.hann_window(win, device=y.device)
            S = torch.stft(y.squeeze(1), n_fft, hop, win, w, return_complex=True).abs().clamp(min=1e-7)
            S_hat = torch.stft(y_hat.squeeze(1), n_fft, hop, win, w, return_complex=True).abs().clamp(min=1e-7)
            sc = sc + torch.norm(S - S_hat, p="fro") / torch.norm(S, p="fro")
            mag = mag + F.l1_loss(S.log(), S_hat.log())
        return (sc + mag) / len(self.resolutions)


def run(rank, cfg):
    n_gpus = cfg["n_gpus"]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{cfg['port']}", world_size=n_gpus, rank=rank)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    torch.manual_seed(cfg["seed"])

    gen = Generator(cfg["n_mels"], cfg["gen_channels"], cfg["upsample_rates"]).to(device)
    disc = MPD().to(device)
    opt_g = torch.optim.AdamW(gen.parameters(), cfg["lr"], betas=(0.8, 0.99))
    opt_d = torch.optim.AdamW(disc.parameters(), cfg["lr"], betas=(0.8, 0.99))
    step = 0
    ckpt = os.path.join(cfg["out_dir"], "ckpt_latest.pt")
    if os.path.exists(ckpt):
        s = torch.load(ckpt, map_location=device)
        gen.load_state_dict(s["gen"]); disc.load_state_dict(s["disc"])
        opt_g.load_state_dict(s["opt_g"]); opt_d.load_state_dict(s["opt_d"])
        step = s["step"]
    gen = DDP(gen, device_ids=[rank])
    disc = DDP(disc, device_ids=[rank])
    stft_loss = MultiResSTFTLoss()

    ds = MelWavDataset(cfg["data_root"], cfg["hop_length"], cfg["segment_frames"])
    sampler = DistributedSampler(ds, num_replicas=n_gpus, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=cfg["batch_size"], sampler=sampler, num_workers=4, pin_memory=True,
                        drop_last=True)
    writer = SummaryWriter(os.path.join(cfg["out_dir"], "tb")) if rank == 0 else None

    epoch = step // len(loader)
    while step < cfg["max_steps"]:
        sampler.set_epoch(epoch)
        for mel, wav in loader:
            mel, wav = mel.to(device, non_blocking=True), wav.to(device, non_blocking=True)
            wav_hat = gen(mel)

            d_real, d_fake = disc(wav), disc(wav_hat.detach())
            loss_d = sum(torch.mean((1 - r) ** 2) + torch.mean(f ** 2) for (r, _), (f, _) in zip(d_real, d_fake))
            opt_d.zero_grad(set_to_none=True)
            loss_d.backward()
            opt_d.step()

            loss_stft = stft_loss(wav_hat, wav)
            d_fake = disc(wav_hat)
            with torch.no_grad():
                d_real = disc(wav)
            loss_adv = sum(torch.mean((1 - f) ** 2) for f, _ in d_fake)
            loss_fm = sum(F.l1_loss(ff, rf.detach()) for (_, rfs), (_, ffs) in zip(d_real, d_fake)
                          for rf, ff in zip(rfs, ffs))
            loss_g = loss_adv + cfg["lambda_fm"] * loss_fm + cfg["lambda_stft"] * loss_stft
            opt_g.zero_grad(set_to_none=True)
            loss_g.backward()
            opt_g.step()
            step += 1

            if rank == 0:
                if step % 100 == 0:
                    writer.add_scalar("d/loss", loss_d.item(), step)
                    writer.add_scalar("g/adv", loss_adv.item(), step)
                    writer.add_scalar("g/fm", loss_fm.item(), step)
                    writer.add_scalar("g/stft", loss_stft.item(), step)
                    print(f"step {step}: D {loss_d.item():.3f} G {loss_g.item():.3f} stft {loss_stft.item():.3f}")
                if step % cfg["save_every"] == 0:
                    torch.save({"gen": gen.module.state_dict(), "disc": disc.module.state_dict(),
                                "opt_g": opt_g.state_dict(), "opt_d": opt_d.state_dict(), "step": step}, ckpt)
                    torch.save(gen.module.state_dict(), os.path.join(cfg["out_dir"], f"g_{step:07d}.pt"))
            if step >= cfg["max_steps"]:
                break
        epoch += 1

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("-c", "--config", required=True)
    a = parser.parse_args()
    with open(a.config) as f:
        cfg = yaml.safe_load(f)
    cfg["n_gpus"] = torch.cuda.device_count()
    cfg["port"] = free_port()
    os.makedirs(cfg["out_dir"], exist_ok=True)
    assert cfg["n_gpus"] > 0, "needs at least one GPU"
    mp.spawn(run, nprocs=cfg["n_gpus"], args=(cfg), join=True)


if __name__ == "__main__":
    main()
