"""Fine-tune a pretrained HiFi-GAN on ground-truth-aligned (teacher-forced) mels from an acoustic model.

torchrun --nproc_per_node=4 15_hifigan_finetune_torchrun.py --config config_v1.json \
    --gta_dir gta_mels/ --wav_dir wavs/ --pretrained cp_hifigan/ --cp_dir cp_hifigan_ft/
"""
import argparse
import glob
import json
import os
import random
import time

import numpy as np
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


class H(dict):
    __getattr__ = dict.__getitem__


def scan_checkpoint(cp_dir, prefix):
    cps = sorted(glob.glob(os.path.join(cp_dir, prefix + "????????")))
    return cps[-1] if cps else None


def save_checkpoint(path, obj):
    print(f"Saving checkpoint to {path}")
    torch.save(obj, path)


class MelSpec(nn.Module):
    def __init__(self, h, fmax):
        super().__init__()
        self.pad = (h.n_fft - h.hop_size) // 2
        self.mel = torchaudio.transforms.MelSpectrogram(h.sampling_rate, n_fft=h.n_fft, win_length=h.win_size,
                                                        hop_length=h.hop_size, f_min=h.fmin, f_max=fmax,
                                                        n_mels=h.num_mels, power=1.0, center=False,
                                                        norm="slaney", mel_scale="slaney")

    def forward(self, y):
        y = F.pad(y, (self.pad, self.pad), mode="reflect")
        return self.mel(y).clamp(min=1e-5).log()


class GTADataset(Dataset):
    def __init__(self, gta_dir, wav_dir, h, train=True):
        self.mels = sorted(glob.glob(os.path.join(gta_dir, "*.npy")))
        self.wav_dir, self.h, self.train = wav_dir, h, train
        self.frames = h.segment_size // h.hop_size

    def __len__(self):
        return len(self.mels)

    def __getitem__(self, i):
        mel = torch.from_numpy(np.load(self.mels[i])).float()  # [80, T]
        name = os.path.basename(self.mels[i])[:-4]
        wav, sr = torchaudio.load(os.path.join(self.wav_dir, name + ".wav"))
        wav = wav[0] * 0.95 / wav.abs().max().clamp(min=1e-4)
        if self.train:
            if mel.size(1) > self.frames:
                s = random.randint(0, mel.size(1) - self.frames - 1)
                mel = mel[:, s:s + self.frames]
                wav = wav[s * self.h.hop_size:(s + self.frames) * self.h.hop_size]
            else:
                mel = F.pad(mel, (0, self.frames - mel.size(1)), value=float(np.log(1e-5)))
            wav = F.pad(wav, (0, max(0, self.h.segment_size - wav.numel())))[: self.h.segment_size]
        return mel, wav


class ResBlock1(nn.Module):
    def __init__(self, ch, k, dil):
        super().__init__()
        self.c1 = nn.ModuleList([weight_norm(nn.Conv1d(ch, ch, k, dilation=d, padding=d * (k - 1) // 2)) for d in dil])
        self.c2 = nn.ModuleList([weight_norm(nn.Conv1d(ch, ch, k, padding=(k - 1) // 2)) for _ in dil])

    def forward(self, x):
        for a, b in zip(self.c1, self.c2):
            x = x + b(F.leaky_relu(a(F.leaky_relu(x, 0.1)), 0.1))
        return x


class Generator(nn.Module):
    def __init__(self, h):
        super().__init__()
        ch = h.upsample_initial_channel
        self.nk = len(h.resblock_kernel_sizes)
        self.conv_pre = weight_norm(nn.Conv1d(h.num_mels, ch, 7, padding=3))
        self.ups, self.resblocks = nn.ModuleList(), nn.ModuleList()
        for u, k in zip(h.upsample_rates, h.upsample_kernel_sizes):
            self.ups.append(weight_norm(nn.ConvTranspose1d(ch, ch // 2, k, u, padding=(k - u) // 2)))
            ch //= 2
            self.resblocks.extend(ResBlock1(ch, rk, rd) for rk, rd in zip(h.resblock_kernel_sizes,
                                                                          h.resblock_dilation_sizes))
        self.conv_post = weight_norm(nn.Conv1d(ch, 1, 7, padding=3))

    def forward(self, x):
        x = self.conv_pre(x)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, 0.1))
            x = sum(self.resblocks[i * self.nk + j](x) for j in range(self.nk)) / self.nk
        return torch.tanh(self.conv_post(F.leaky_relu(x)))


class DiscP(nn.Module):
    def __init__(self, period):
        super().__init__()
        self.period = period
        chs = [1, 32, 128, 512, 1024, 1024]
        self.convs = nn.ModuleList([weight_norm(nn.Conv2d(chs[i], chs[i + 1], (5, 1), (3, 1) if i < 4 else 1, (2, 0)))
                                    for i in range(5)])
        self.post = weight_norm(nn.Conv2d(1024, 1, (3, 1), 1, (1, 0)))

    def forward(self, x):
        b, c, t = x.shape
        if t % self.period:
            x = F.pad(x, (0, self.period - t % self.period), "reflect")
        x = x.view(b, c, -1, self.period)
        fmap = []
        for conv in self.convs:
            x = F.leaky_relu(conv(x), 0.1)
            fmap.append(x)
        x = self.post(x)
        fmap.append(x)
        return x.flatten(1), fmap


class MPD(nn.Module):
    def __init__(self):
        super().__init__()
        self.discriminators = nn.ModuleList([DiscP(p) for p in (2, 3, 5, 7, 11)])

    def forward(self, y, y_hat):
        r, g, fr, fg = [], [], [], []
        for d in self.discriminators:
            a, fa = d(y)
            b, fb = d(y_hat)
            r.append(a); g.append(b); fr.append(fa); fg.append(fb)
        return r, g, fr, fg


def d_loss(r, g):
    return sum(torch.mean((1 - a) ** 2) + torch.mean(b ** 2) for a, b in zip(r, g))


def g_loss(g):
    return sum(torch.mean((1 - b) ** 2) for b in g)


def fm_loss(fr, fg):
    return 2 * sum(torch.mean(torch.abs(a - b)) for da, db in zip(fr, fg) for a, b in zip(da, db))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--gta_dir", required=True)
    ap.add_argument("--wav_dir", required=True)
    ap.add_argument("--pretrained", default=None)
    ap.add_argument("--cp_dir", required=True)
    ap.add_argument("--max_steps", type=int, default=100000)
    ap.add_argument("--checkpoint_interval", type=int, default=5000)
    ap.add_argument("--summary_interval", type=int, default=100)
    a = ap.parse_args()
    with open(a.config) as f:
        h = H(json.load(f))

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(h.seed)

    generator, mpd = Generator(h).to(device), MPD().to(device)
    mel_loss_fn = MelSpec(h, h.fmax_for_loss).to(device)
    os.makedirs(a.cp_dir, exist_ok=True)

    cp_g = scan_checkpoint(a.cp_dir, "g_") or (scan_checkpoint(a.pretrained, "g_") if a.pretrained else None)
    cp_do = scan_checkpoint(a.cp_dir, "do_") or (scan_checkpoint(a.pretrained, "do_") if a.pretrained else None)
    steps, state_do = 0, None
    if cp_g is not None:
        generator.load_state_dict(torch.load(cp_g, map_location=device)["generator"])
        state_do = torch.load(cp_do, map_location=device)
        mpd.load_state_dict(state_do["mpd"])
        if os.path.dirname(cp_do) == os.path.normpath(a.cp_dir):
            steps = state_do["steps"] + 1

    generator = DDP(generator, device_ids=[local_rank])
    mpd = DDP(mpd, device_ids=[local_rank])
    optim_g = torch.optim.AdamW(generator.parameters(), h.learning_rate, betas=(h.adam_b1, h.adam_b2))
    optim_d = torch.optim.AdamW(mpd.parameters(), h.learning_rate, betas=(h.adam_b1, h.adam_b2))
    if state_do is not None and steps > 0:
        optim_g.load_state_dict(state_do["optim_g"])
        optim_d.load_state_dict(state_do["optim_d"])

    trainset = GTADataset(a.gta_dir, a.wav_dir, h)
    sampler = DistributedSampler(trainset, shuffle=True, drop_last=True)
    loader = DataLoader(trainset, batch_size=h.batch_size, sampler=sampler, num_workers=h.num_workers,
                        pin_memory=True, drop_last=True)
    sw = SummaryWriter(os.path.join(a.cp_dir, "logs")) if rank == 0 else None

    generator.train(); mpd.train()
    epoch = steps // len(loader)
    while steps < a.max_steps:
        sampler.set_epoch(epoch)
        t0 = time.time()
        for mel, y in loader:
            mel, y = mel.to(device, non_blocking=True), y.to(device, non_blocking=True).unsqueeze(1)
            y_hat = generator(mel)

            optim_d.zero_grad()
            r, g, _, _ = mpd(y, y_hat.detach())
            loss_d = d_loss(r, g)
            loss_d.backward()
            optim_d.step()

            optim_g.zero_grad()
            loss_mel = F.l1_loss(mel_loss_fn(y.squeeze(1)), mel_loss_fn(y_hat.squeeze(1))) * 45
            _, g, fr, fg = mpd(y, y_hat)
            loss_g = g_loss(g) + fm_loss(fr, fg) + loss_mel
            loss_g.backward()
            optim_g.step()

            if rank == 0 and steps % a.summary_interval == 0:
                sw.add_scalar("training/gen_loss_total", loss_g.item(), steps)
                sw.add_scalar("training/mel_spec_error", loss_mel.item() / 45, steps)
                sw.add_scalar("training/disc_loss", loss_d.item(), steps)
                print(f"Steps {steps}, gen {loss_g.item():.3f}, mel {loss_mel.item() / 45:.3f}, "
                      f"{time.time() - t0:.1f}s/it", flush=True)

            if steps % a.checkpoint_interval == 0 and steps != 0:
                save_checkpoint(os.path.join(a.cp_dir, f"g_{steps:08d}"),
                                {"generator": generator.module.state_dict()})
                save_checkpoint(os.path.join(a.cp_dir, f"do_{steps:08d}"),
                                {"mpd": mpd.module.state_dict(), "optim_g": optim_g.state_dict(),
                                 "optim_d": optim_d.state_dict(), "steps": steps, "epoch": epoch})
            steps += 1
            t0 = time.time()
            if steps >= a.max_steps:
                break
        epoch += 1

    if sw is not None:
        sw.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
