# Neural vocoder (HiFi-GAN V1 generator) with multi-resolution spectrogram discriminators.
# Our fork: swapped MPD/MSD for 2D spec discriminators (faster, better on singing data).
#
#   torchrun --standalone --nproc_per_node=4 11_vocoder_gan_ddp.py --config cfg/v1_spec.json
import argparse
import glob
import itertools
import json
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
from torch.nn.utils import remove_weight_norm, weight_norm
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

LRELU = 0.1


class AttrDict(dict):
    __getattr__ = dict.__getitem__


class MelFn(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(
            sample_rate=h.sampling_rate, n_fft=h.n_fft, win_length=h.win_size, hop_length=h.hop_size,
            f_min=h.fmin, f_max=h.fmax, n_mels=h.num_mels, power=1.0, center=False,
        )

    def forward(self, y):
        pad = (self.mel.n_fft - self.mel.hop_length) // 2
        y = F.pad(y.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
        return torch.log(torch.clamp(self.mel(y), min=1e-5))


class WavDataset(Dataset):
    def __init__(self, wav_dir, segment_size, sr):
        self.files = sorted(glob.glob(os.path.join(wav_dir, "**", "*.wav"), recursive=True))
        self.segment_size = segment_size
        self.sr = sr

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        wav, sr = sf.read(self.files[i], dtype="float32")
        assert sr == self.sr, f"{self.files[i]} has sr {sr}"
        wav = 0.95 * wav / (np.abs(wav).max() + 1e-7)
        if len(wav) >= self.segment_size:
            start = random.randint(0, len(wav) - self.segment_size)
            wav = wav[start : start + self.segment_size]
        else:
            wav = np.pad(wav, (0, self.segment_size - len(wav)))
        return torch.from_numpy(wav)


class ResBlock(nn.Module):
    def __init__(self, ch, k, dil):
        super().__init__()
        self.c1 = nn.ModuleList([weight_norm(nn.Conv1d(ch, ch, k, dilation=d, padding=(k * d - d) // 2)) for d in dil])
        self.c2 = nn.ModuleList([weight_norm(nn.Conv1d(ch, ch, k, padding=(k - 1) // 2)) for _ in dil])

    def forward(self, x):
        for a, b in zip(self.c1, self.c2):
            x = x + b(F.leaky_relu(a(F.leaky_relu(x, LRELU)), LRELU))
        return x


class Generator(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.pre = weight_norm(nn.Conv1d(h.num_mels, h.upsample_initial_channel, 7, padding=3))
        self.ups = nn.ModuleList()
        self.res = nn.ModuleList()
        ch = h.upsample_initial_channel
        for u, k in zip(h.upsample_rates, h.upsample_kernel_sizes):
            self.ups.append(weight_norm(nn.ConvTranspose1d(ch, ch // 2, k, u, padding=(k - u) // 2)))
            ch //= 2
            self.res.append(nn.ModuleList([ResBlock(ch, rk, rd) for rk, rd in zip(h.resblock_kernel_sizes,
                                                                                  h.resblock_dilation_sizes)]))
        self.post = weight_norm(nn.Conv1d(ch, 1, 7, padding=3))

    def forward(self, mel):
        x = self.pre(mel)
        for up, blocks in zip(self.ups, self.res):
            x = up(F.leaky_relu(x, LRELU))
            x = sum(b(x) for b in blocks) / len(blocks)
        return torch.tanh(self.post(F.leaky_relu(x))).squeeze(1)


class SpecDiscriminator(nn.Module):
    def __init__(self, n_fft, hop):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        chans = [1, 32, 64, 128, 128]
        layers = []
        for cin, cout in zip(chans[:-1], chans[1:]):
            layers.append(nn.Sequential(nn.Conv2d(cin, cout, (3, 9), stride=(1, 2), padding=(1, 4)),
                                        nn.BatchNorm2d(cout), nn.LeakyReLU(LRELU)))
        self.convs = nn.ModuleList(layers)
        self.out = nn.Conv2d(chans[-1], 1, (3, 3), padding=1)

    def forward(self, y):
        s = torch.stft(y, self.n_fft, self.hop, window=self.window, return_complex=True).abs().unsqueeze(1)
        fmaps = []
        x = s.transpose(2, 3)
        for c in self.convs:
            x = c(x)
            fmaps.append(x)
        x = self.out(x)
        fmaps.append(x)
        return x.flatten(1), fmaps


class MultiResSpecD(nn.Module):
    def __init__(self):
        super().__init__()
        self.ds = nn.ModuleList([SpecDiscriminator(n, h) for n, h in [(512, 128), (1024, 256), (2048, 512)]])

    def forward(self, y):
        return [d(y) for d in self.ds]


def d_loss(real_outs, fake_outs):
    return sum(torch.mean((1 - r[0]) ** 2) + torch.mean(f[0] ** 2) for r, f in zip(real_outs, fake_outs))


def g_adv_loss(fake_outs):
    return sum(torch.mean((1 - f[0]) ** 2) for f in fake_outs)


def fm_loss(real_outs, fake_outs):
    return sum(F.l1_loss(fm_f, fm_r.detach()) for r, f in zip(real_outs, fake_outs) for fm_r, fm_f in zip(r[1], f[1]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--wav_dir", default="data/wavs")
    ap.add_argument("--ckpt_dir", default="cp_spec")
    ap.add_argument("--epochs", type=int, default=3100)
    args = ap.parse_args()
    h = AttrDict(json.load(open(args.config)))

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(h.seed)

    gen = Generator(h).to(device)
    disc = MultiResSpecD().to(device)
    mel_fn = MelFn(h).to(device)
    opt_g = torch.optim.AdamW(gen.parameters(), h.learning_rate, betas=(h.adam_b1, h.adam_b2))
    opt_d = torch.optim.AdamW(disc.parameters(), h.learning_rate, betas=(h.adam_b1, h.adam_b2))

    step, last_epoch = 0, -1
    cps = sorted(glob.glob(os.path.join(args.ckpt_dir, "state_*.pt")))
    if cps:
        st = torch.load(cps[-1], map_location=device)
        gen.load_state_dict(st["gen"]); disc.load_state_dict(st["disc"])
        opt_g.load_state_dict(st["opt_g"]); opt_d.load_state_dict(st["opt_d"])
        step, last_epoch = st["step"], st["epoch"]

    gen = DDP(gen, device_ids=[local_rank])
    disc = DDP(disc, device_ids=[local_rank])
    sch_g = torch.optim.lr_scheduler.ExponentialLR(opt_g, gamma=h.lr_decay, last_epoch=last_epoch)
    sch_d = torch.optim.lr_scheduler.ExponentialLR(opt_d, gamma=h.lr_decay, last_epoch=last_epoch)

    ds = WavDataset(args.wav_dir, h.segment_size, h.sampling_rate)
    sampler = DistributedSampler(ds, shuffle=True)
    dl = DataLoader(ds, batch_size=h.batch_size, sampler=sampler, num_workers=h.num_workers, drop_last=True,
                    pin_memory=True)

    sw = None
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        sw = SummaryWriter(os.path.join(args.ckpt_dir, "logs"))

    gen.train(); disc.train()
    for epoch in range(max(0, last_epoch + 1), args.epochs):
        sampler.set_epoch(epoch)
        for y in dl:
            y = y.to(device, non_blocking=True)
            with torch.no_grad():
                mel = mel_fn(y)
            y_hat = gen(mel)
            y_hat = y_hat[:, : y.shape[1]]

            # discriminator
            opt_d.zero_grad(set_to_none=True)
            real = disc(y)
            fake = disc(y_hat.detach())
            loss_d = d_loss(real, fake)
            loss_d.backward()
            opt_d.step()

            # generator
            opt_g.zero_grad(set_to_none=True)
            loss_mel = F.l1_loss(mel_fn(y_hat), mel) * 45
            real = disc(y)
            fake = disc(y_hat)
            loss_g = g_adv_loss(fake) + 2.0 * fm_loss(real, fake) + loss_mel
            loss_g.backward()
            opt_g.step()
            step += 1

            if rank == 0:
                if step % h.stdout_interval == 0:
                    print(f"step {step} gen {loss_g.item():.3f} disc {loss_d.item():.3f} mel {loss_mel.item() / 45:.3f}",
                          flush=True)
                if step % h.summary_interval == 0:
                    sw.add_scalar("train/gen_total", loss_g.item(), step)
                    sw.add_scalar("train/disc_total", loss_d.item(), step)
                    sw.add_scalar("train/mel_l1", loss_mel.item() / 45, step)
                if step % h.checkpoint_interval == 0:
                    torch.save({"gen": gen.module.state_dict(), "disc": disc.module.state_dict(),
                                "opt_g": opt_g.state_dict(), "opt_d": opt_d.state_dict(),
                                "step": step, "epoch": epoch},
                               os.path.join(args.ckpt_dir, f"state_{step:08d}.pt"))
        sch_g.step()
        sch_d.step()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
