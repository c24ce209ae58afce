"""BigVGAN-style universal vocoder: Snake activations, MPD + multi-resolution (spectrogram) discriminator."""
import argparse
import itertools
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
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from meldataset import MelDataset, mel_spectrogram, get_dataset_filelist
from env import AttrDict


class Snake(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.log_alpha = nn.Parameter(torch.zeros(1, channels, 1))

    def forward(self, x):
        a = self.log_alpha.exp()
        return x + (1.0 / (a + 1e-9)) * torch.sin(x * a) ** 2


class AMPBlock(nn.Module):
    def __init__(self, ch, k=3, dilations=(1, 3, 5)):
        super().__init__()
        self.convs1 = nn.ModuleList([weight_norm(nn.Conv1d(ch, ch, k, dilation=d, padding=d * (k - 1) // 2))
                                     for d in dilations])
        self.convs2 = nn.ModuleList([weight_norm(nn.Conv1d(ch, ch, k, padding=(k - 1) // 2)) for _ in dilations])
        self.acts = nn.ModuleList([Snake(ch) for _ in range(2 * len(dilations))])

    def forward(self, x):
        for i, (c1, c2) in enumerate(zip(self.convs1, self.convs2)):
            xt = c2(self.acts[2 * i + 1](c1(self.acts[2 * i](x))))
            x = x + xt
        return x


class BigVGAN(nn.Module):
    def __init__(self, h):
        super().__init__()
        ch = h.upsample_initial_channel
        self.num_kernels = len(h.resblock_kernel_sizes)
        self.conv_pre = weight_norm(nn.Conv1d(h.num_mels, ch, 7, padding=3))
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        for i, (u, k) in enumerate(zip(h.upsample_rates, h.upsample_kernel_sizes)):
            self.ups.append(weight_norm(nn.ConvTranspose1d(ch // 2 ** i, ch // 2 ** (i + 1), k, u, padding=(k - u) // 2)))
            for rk, rd in zip(h.resblock_kernel_sizes, h.resblock_dilation_sizes):
                self.resblocks.append(AMPBlock(ch // 2 ** (i + 1), rk, rd))
        self.act_post = Snake(ch // 2 ** len(self.ups))
        self.conv_post = weight_norm(nn.Conv1d(ch // 2 ** len(self.ups), 1, 7, padding=3))

    def forward(self, x):
        x = self.conv_pre(x)
        for i, up in enumerate(self.ups):
            x = up(x)
            x = sum(self.resblocks[i * self.num_kernels + j](x) for j in range(self.num_kernels)) / self.num_kernels
        return torch.tanh(self.conv_post(self.act_post(x)))


class DiscriminatorR(nn.Module):
    def __init__(self, resolution):
        super().__init__()
        self.n_fft, self.hop, self.win = resolution
        self.register_buffer("window", torch.hann_window(self.win))
        self.convs = nn.ModuleList([
            weight_norm(nn.Conv2d(1, 32, (3, 9), padding=(1, 4))),
            weight_norm(nn.Conv2d(32, 32, (3, 9), stride=(1, 2), padding=(1, 4))),
            weight_norm(nn.Conv2d(32, 32, (3, 9), stride=(1, 2), padding=(1, 4))),
            weight_norm(nn.Conv2d(32, 32, (3, 9), stride=(1, 2), padding=(1, 4))),
            weight_norm(nn.Conv2d(32, 32, (3, 3), padding=(1, 1))),
        ])
        self.conv_post = weight_norm(nn.Conv2d(32, 1, (3, 3), padding=(1, 1)))

    def forward(self, x):
        spec = torch.stft(x.squeeze(1), self.n_fft, self.hop, self.win, self.window, center=True, return_complex=True)
        x = spec.abs().unsqueeze(1)
        fmap = []
        for c in self.convs:
            x = F.leaky_relu(c(x), 0.1)
            fmap.append(x)
        x = self.conv_post(x)
        fmap.append(x)
        return torch.flatten(x, 1, -1), fmap


class DiscriminatorP(nn.Module):
    def __init__(self, period):
        super().__init__()
        self.period = period
        chs = [1, 32, 128, 512, 1024, 1024]
        self.convs = nn.ModuleList([weight_norm(nn.Conv2d(chs[i], chs[i + 1], (5, 1), (3 if i < 4 else 1, 1),
                                                          padding=(2, 0))) for i in range(5)])
        self.conv_post = weight_norm(nn.Conv2d(1024, 1, (3, 1), padding=(1, 0)))

    def forward(self, x):
        b, c, t = x.shape
        if t % self.period:
            x = F.pad(x, (0, self.period - t % self.period), "reflect")
        x = x.view(b, c, -1, self.period)
        fmap = []
        for l in self.convs:
            x = F.leaky_relu(l(x), 0.1)
            fmap.append(x)
        x = self.conv_post(x)
        fmap.append(x)
        return torch.flatten(x, 1, -1), fmap


class CombinedDiscriminator(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.discs = nn.ModuleList([DiscriminatorP(p) for p in h.mpd_reshapes] +
                                   [DiscriminatorR(r) for r in h.resolutions])

    def forward(self, y, y_hat):
        outs = [(d(y), d(y_hat)) for d in self.discs]
        return ([o[0][0] for o in outs], [o[1][0] for o in outs], [o[0][1] for o in outs], [o[1][1] for o in outs])


def feature_loss(fr, fg):
    return 2 * sum(torch.mean(torch.abs(r - g)) for dr, dg in zip(fr, fg) for r, g in zip(dr, dg))


def discriminator_loss(real, fake):
    return sum(torch.mean((1 - r) ** 2) + torch.mean(f ** 2) for r, f in zip(real, fake))


def generator_loss(fake):
    return sum(torch.mean((1 - f) ** 2) for f in fake)


def reduce_tensor(t):
    t = t.detach().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / dist.get_world_size()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--input_training_file", required=True)
    ap.add_argument("--input_validation_file", required=True)
    ap.add_argument("--input_wavs_dir", required=True)
    ap.add_argument("--checkpoint_path", default="exp/bigvgan")
    ap.add_argument("--training_epochs", type=int, default=100000)
    ap.add_argument("--validation_interval", type=int, default=5000)
    ap.add_argument("--checkpoint_interval", type=int, default=25000)
    a = ap.parse_args()
    with open(a.config) as f:
        h = AttrDict(json.load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(h.seed)

    train_files, val_files = get_dataset_filelist(a)
    trainset = MelDataset(train_files, h.segment_size, h.n_fft, h.num_mels, h.hop_size, h.win_size,
                          h.sampling_rate, h.fmin, h.fmax, n_cache_reuse=0, shuffle=False, fmax_loss=h.fmax_for_loss)
    sampler = DistributedSampler(trainset, shuffle=True, drop_last=True)
    loader = DataLoader(trainset, batch_size=h.batch_size, sampler=sampler, num_workers=h.num_workers,
                        pin_memory=True, drop_last=True)

    generator = BigVGAN(h).to(device)
    disc = CombinedDiscriminator(h).to(device)
    optim_g = torch.optim.AdamW(generator.parameters(), h.learning_rate, betas=(h.adam_b1, h.adam_b2))
    optim_d = torch.optim.AdamW(disc.parameters(), h.learning_rate, betas=(h.adam_b1, h.adam_b2))
    steps, last_epoch = 0, -1
    cp = os.path.join(a.checkpoint_path, "last.pt")
    if os.path.isfile(cp):
        st = torch.load(cp, map_location="cpu")
        generator.load_state_dict(st["generator"]); disc.load_state_dict(st["disc"])
        optim_g.load_state_dict(st["optim_g"]); optim_d.load_state_dict(st["optim_d"])
        steps, last_epoch = st["steps"] + 1, st["epoch"]
    sched_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, h.lr_decay, last_epoch=last_epoch)
    sched_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, h.lr_decay, last_epoch=last_epoch)
    generator = DDP(generator, device_ids=[local_rank])
    disc = DDP(disc, device_ids=[local_rank])

    sw = None
    if rank == 0:
        os.makedirs(a.checkpoint_path, exist_ok=True)
        sw = SummaryWriter(os.path.join(a.checkpoint_path, "logs"))
        valset = MelDataset(val_files, h.segment_size, h.n_fft, h.num_mels, h.hop_size, h.win_size, h.sampling_rate,
                            h.fmin, h.fmax, split=False, shuffle=False, n_cache_reuse=0, fmax_loss=h.fmax_for_loss)
        val_loader = DataLoader(valset, batch_size=1, num_workers=1, shuffle=False)

    for epoch in range(max(0, last_epoch), a.training_epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for x, y, _, y_mel in loader:
            x, y, y_mel = x.to(device, non_blocking=True), y.to(device, non_blocking=True).unsqueeze(1), y_mel.to(device)
            y_g_hat = generator(x)
            y_g_hat_mel = mel_spectrogram(y_g_hat.squeeze(1), h.n_fft, h.num_mels, h.sampling_rate, h.hop_size,
                                          h.win_size, h.fmin, h.fmax_for_loss)

            optim_d.zero_grad()
            y_d_r, y_d_g, _, _ = disc(y, y_g_hat.detach())
            loss_disc = discriminator_loss(y_d_r, y_d_g)
            loss_disc.backward()
            grad_norm_d = torch.nn.utils.clip_grad_norm_(disc.parameters(), 1000.0)
            optim_d.step()

            optim_g.zero_grad()
            loss_mel = F.l1_loss(y_mel, y_g_hat_mel) * 45
            _, y_d_g, fmap_r, fmap_g = disc(y, y_g_hat)
            loss_gen_all = generator_loss(y_d_g) + feature_loss(fmap_r, fmap_g) + loss_mel
            loss_gen_all.backward()
            grad_norm_g = torch.nn.utils.clip_grad_norm_(generator.parameters(), 1000.0)
            optim_g.step()

            if steps % 100 == 0:
                mel_err = reduce_tensor(loss_mel).item() / 45
                g_total = reduce_tensor(loss_gen_all).item()
                if rank == 0:
                    print(f"Steps {steps} | gen {g_total:.3f} | mel err {mel_err:.4f} | "
                          f"|g| {grad_norm_g:.1f} |d| {grad_norm_d:.1f} | {time.time() - t0:.1f}s")
                    sw.add_scalar("training/gen_loss_total", g_total, steps)
                    sw.add_scalar("training/mel_spec_error", mel_err, steps)

            if rank == 0 and steps % a.checkpoint_interval == 0 and steps != 0:
                torch.save({"generator": generator.module.state_dict(), "disc": disc.module.state_dict(),
                            "optim_g": optim_g.state_dict(), "optim_d": optim_d.state_dict(),
                            "steps": steps, "epoch": epoch}, cp)
                torch.save({"generator": generator.module.state_dict()},
                           os.path.join(a.checkpoint_path, f"g_{steps:08d}"))

            if rank == 0 and steps % a.validation_interval == 0:
                generator.eval()
                val_err = torch.zeros((), device=device)
                with torch.no_grad():
                    for j, (vx, vy, _, vy_mel) in enumerate(val_loader):
                        vy_hat = generator.module(vx.to(device))
                        vy_hat_mel = mel_spectrogram(vy_hat.squeeze(1), h.n_fft, h.num_mels, h.sampling_rate,
                                                     h.hop_size, h.win_size, h.fmin, h.fmax_for_loss)
                        n = min(vy_mel.size(-1), vy_hat_mel.size(-1))
                        val_err += F.l1_loss(vy_mel.to(device)[..., :n], vy_hat_mel[..., :n])
                        if j < 5:
                            sw.add_audio(f"generated/y_hat_{j}", vy_hat[0], steps, h.sampling_rate)
                val_err = reduce_tensor(val_err / len(val_loader))
                sw.add_scalar("validation/mel_spec_error", val_err.item(), steps)
                generator.train()

            steps += 1
        sched_g.step()
        sched_d.step()
        if rank == 0:
            print(f"Epoch {epoch + 1} took {int(time.time() - t0)} s")

    if sw is not None:
        sw.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
