"""HiFi-GAN (V1-style) vocoder training, one process per GPU via mp.spawn.

    python 02_hifigan_spawn.py --config config_v1.json --input_training_file filelists/train.txt
"""
import argparse
import itertools
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import remove_weight_norm, spectral_norm, weight_norm
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

LRELU_SLOPE = 0.1
_mel_cache = {}


class AttrDict(dict):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.__dict__ = self


def mel_spectrogram(y, h, fmax=None):
    key = (str(fmax), str(y.device))
    if key not in _mel_cache:
        _mel_cache[key] = torchaudio.transforms.MelSpectrogram(
            sample_rate=h.sampling_rate, n_fft=h.n_fft, win_length=h.win_size, hop_length=h.hop_size,
            f_min=h.fmin, f_max=fmax, n_mels=h.num_mels, power=1.0, center=False,
            norm="slaney", mel_scale="slaney").to(y.device)
    pad = (h.n_fft - h.hop_size) // 2
    y = F.pad(y.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    return torch.log(torch.clamp(_mel_cache[key](y), min=1e-5))


class MelDataset(Dataset):
    def __init__(self, filelist, h, split=True):
        with open(filelist) as f:
            self.files = [l.split("|")[0].strip() for l in f if l.strip()]
        self.h = h
        self.split = split

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        audio, sr = torchaudio.load(self.files[i])
        assert sr == self.h.sampling_rate, f"{self.files[i]}: {sr}"
        audio = audio[0] * 0.95 / audio.abs().max().clamp(min=1e-4)
        if self.split:
            seg = self.h.segment_size
            if audio.numel() >= seg:
                start = torch.randint(0, audio.numel() - seg + 1, (1,)).item()
                audio = audio[start:start + seg]
            else:
                audio = F.pad(audio, (0, seg - audio.numel()))
        mel = mel_spectrogram(audio.unsqueeze(0), self.h, fmax=self.h.fmax).squeeze(0)
        return mel, audio


class ResBlock(nn.Module):
    def __init__(self, ch, k, dilations):
        super().__init__()
        self.convs1 = nn.ModuleList([weight_norm(nn.Conv1d(ch, ch, k, 1, dilation=d, padding=(k * d - d) // 2))
                                     for d in dilations])
        self.convs2 = nn.ModuleList([weight_norm(nn.Conv1d(ch, ch, k, 1, padding=(k - 1) // 2))
                                     for _ in dilations])

    def forward(self, x):
        for c1, c2 in zip(self.convs1, self.convs2):
            xt = c2(F.leaky_relu(c1(F.leaky_relu(x, LRELU_SLOPE)), LRELU_SLOPE))
            x = x + xt
        return x

    def remove_weight_norm(self):
        for c in itertools.chain(self.convs1, self.convs2):
            remove_weight_norm(c)


class Generator(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.num_kernels = len(h.resblock_kernel_sizes)
        self.conv_pre = weight_norm(nn.Conv1d(h.num_mels, h.upsample_initial_channel, 7, 1, padding=3))
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        ch = h.upsample_initial_channel
        for u, k in zip(h.upsample_rates, h.upsample_kernel_sizes):
            self.ups.append(weight_norm(nn.ConvTranspose1d(ch, ch // 2, k, u, padding=(k - u) // 2)))
            ch //= 2
            for rk, rd in zip(h.resblock_kernel_sizes, h.resblock_dilation_sizes):
                self.resblocks.append(ResBlock(ch, rk, rd))
        self.conv_post = weight_norm(nn.Conv1d(ch, 1, 7, 1, padding=3))

    def forward(self, x):
        x = self.conv_pre(x)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, LRELU_SLOPE))
            xs = sum(self.resblocks[i * self.num_kernels + j](x) for j in range(self.num_kernels))
            x = xs / self.num_kernels
        return torch.tanh(self.conv_post(F.leaky_relu(x)))

    def remove_weight_norm(self):
        for l in self.ups:
            remove_weight_norm(l)
        for b in self.resblocks:
            b.remove_weight_norm()
        remove_weight_norm(self.conv_pre)
        remove_weight_norm(self.conv_post)


class DiscriminatorP(nn.Module):
    def __init__(self, period):
        super().__init__()
        self.period = period
        chans = [1, 32, 128, 512, 1024]
        self.convs = nn.ModuleList([weight_norm(nn.Conv2d(chans[i], chans[i + 1], (5, 1), (3, 1), padding=(2, 0)))
                                    for i in range(4)])
        self.convs.append(weight_norm(nn.Conv2d(1024, 1024, (5, 1), 1, padding=(2, 0))))
        self.conv_post = weight_norm(nn.Conv2d(1024, 1, (3, 1), 1, padding=(1, 0)))

    def forward(self, x):
        fmap = []
        b, c, t = x.shape
        if t % self.period:
            x = F.pad(x, (0, self.period - t % self.period), "reflect")
            t = x.shape[-1]
        x = x.view(b, c, t // self.period, self.period)
        for l in self.convs:
            x = F.leaky_relu(l(x), LRELU_SLOPE)
            fmap.append(x)
        x = self.conv_post(x)
        fmap.append(x)
        return torch.flatten(x, 1, -1), fmap


class DiscriminatorS(nn.Module):
    def __init__(self, use_spectral_norm=False):
        super().__init__()
        norm = spectral_norm if use_spectral_norm else weight_norm
        self.convs = nn.ModuleList([
            norm(nn.Conv1d(1, 128, 15, 1, padding=7)),
            norm(nn.Conv1d(128, 128, 41, 2, groups=4, padding=20)),
            norm(nn.Conv1d(128, 256, 41, 2, groups=16, padding=20)),
            norm(nn.Conv1d(256, 512, 41, 4, groups=16, padding=20)),
            norm(nn.Conv1d(512, 1024, 41, 4, groups=16, padding=20)),
            norm(nn.Conv1d(1024, 1024, 5, 1, padding=2)),
        ])
        self.conv_post = norm(nn.Conv1d(1024, 1, 3, 1, padding=1))

    def forward(self, x):
        fmap = []
        for l in self.convs:
            x = F.leaky_relu(l(x), LRELU_SLOPE)
            fmap.append(x)
        x = self.conv_post(x)
        fmap.append(x)
        return torch.flatten(x, 1, -1), fmap


class MultiPeriodDiscriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.discriminators = nn.ModuleList([DiscriminatorP(p) for p in (2, 3, 5, 7, 11)])

    def forward(self, y, y_hat):
        outs = [(d(y), d(y_hat)) for d in self.discriminators]
        return ([o[0][0] for o in outs], [o[1][0] for o in outs],
                [o[0][1] for o in outs], [o[1][1] for o in outs])


class MultiScaleDiscriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.discriminators = nn.ModuleList([DiscriminatorS(True), DiscriminatorS(), DiscriminatorS()])
        self.pools = nn.ModuleList([nn.AvgPool1d(4, 2, padding=2), nn.AvgPool1d(4, 2, padding=2)])

    def forward(self, y, y_hat):
        rs, gs, frs, fgs = [], [], [], []
        for i, d in enumerate(self.discriminators):
            if i > 0:
                y, y_hat = self.pools[i - 1](y), self.pools[i - 1](y_hat)
            (r, fr), (g, fg) = d(y), d(y_hat)
            rs.append(r); gs.append(g); frs.append(fr); fgs.append(fg)
        return rs, gs, frs, fgs


def feature_loss(fmap_r, fmap_g):
    return 2 * sum(torch.mean(torch.abs(rl - gl)) for dr, dg in zip(fmap_r, fmap_g) for rl, gl in zip(dr, dg))


def discriminator_loss(real, fake):
    return sum(torch.mean((1 - dr) ** 2) + torch.mean(dg ** 2) for dr, dg in zip(real, fake))


def generator_loss(fake):
    return sum(torch.mean((1 - dg) ** 2) for dg in fake)


def train(rank, a, h):
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", str(a.port))
    dist.init_process_group("nccl", rank=rank, world_size=h.num_gpus)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    torch.manual_seed(h.seed)

    generator = Generator(h).to(device)
    mpd = MultiPeriodDiscriminator().to(device)
    msd = MultiScaleDiscriminator().to(device)
    optim_g = torch.optim.AdamW(generator.parameters(), h.learning_rate, betas=(h.adam_b1, h.adam_b2))
    optim_d = torch.optim.AdamW(itertools.chain(msd.parameters(), mpd.parameters()),
                                h.learning_rate, betas=(h.adam_b1, h.adam_b2))

    steps, last_epoch = 0, -1
    ckpt_path = os.path.join(a.checkpoint_path, "last.pt")
    if os.path.isfile(ckpt_path):
        state = torch.load(ckpt_path, map_location=device)
        generator.load_state_dict(state["generator"])
        mpd.load_state_dict(state["mpd"])
        msd.load_state_dict(state["msd"])
        optim_g.load_state_dict(state["optim_g"])
        optim_d.load_state_dict(state["optim_d"])
        steps, last_epoch = state["steps"] + 1, state["epoch"]

    generator = DistributedDataParallel(generator, device_ids=[rank])
    mpd = DistributedDataParallel(mpd, device_ids=[rank])
    msd = DistributedDataParallel(msd, device_ids=[rank])

    sched_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, h.lr_decay, last_epoch=last_epoch)
    sched_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, h.lr_decay, last_epoch=last_epoch)

    trainset = MelDataset(a.input_training_file, h)
    sampler = DistributedSampler(trainset, shuffle=True, drop_last=True)
    loader = DataLoader(trainset, batch_size=h.batch_size, sampler=sampler, num_workers=h.num_workers,
                        pin_memory=True, drop_last=True)

    sw = None
    if rank == 0:
        os.makedirs(a.checkpoint_path, exist_ok=True)
        sw = SummaryWriter(os.path.join(a.checkpoint_path, "logs"))
        validset = MelDataset(a.input_validation_file, h, split=False)
        valid_loader = DataLoader(validset, batch_size=1, num_workers=1)

    generator.train(); mpd.train(); msd.train()
    for epoch in range(max(0, last_epoch), a.training_epochs):
        sampler.set_epoch(epoch)
        start = time.time()
        for mel, y in loader:
            mel, y = mel.to(device, non_blocking=True), y.to(device, non_blocking=True).unsqueeze(1)
            y_g_hat = generator(mel)
            y_g_hat_mel = mel_spectrogram(y_g_hat.squeeze(1), h, fmax=h.fmax_for_loss)
            y_mel = mel_spectrogram(y.squeeze(1), h, fmax=h.fmax_for_loss)

            optim_d.zero_grad()
            r, g, _, _ = mpd(y, y_g_hat.detach())
            loss_disc_f = discriminator_loss(r, g)
            r, g, _, _ = msd(y, y_g_hat.detach())
            loss_disc_s = discriminator_loss(r, g)
            (loss_disc_s + loss_disc_f).backward()
            optim_d.step()

            optim_g.zero_grad()
            loss_mel = F.l1_loss(y_mel, y_g_hat_mel) * 45
            _, f_g, f_fr, f_fg = mpd(y, y_g_hat)
            _, s_g, s_fr, s_fg = msd(y, y_g_hat)
            loss_gen_all = (generator_loss(s_g) + generator_loss(f_g) + feature_loss(f_fr, f_fg)
                            + feature_loss(s_fr, s_fg) + loss_mel)
            loss_gen_all.backward()
            optim_g.step()

            if rank == 0:
                if steps % a.stdout_interval == 0:
                    print(f"Steps {steps} gen {loss_gen_all.item():.3f} mel {loss_mel.item() / 45:.3f} "
                          f"disc {(loss_disc_s + loss_disc_f).item():.3f} {time.time() - start:.1f}s")
                if steps % a.summary_interval == 0:
                    sw.add_scalar("training/gen_loss_total", loss_gen_all.item(), steps)
                    sw.add_scalar("training/mel_spec_error", loss_mel.item() / 45, steps)
                if steps % a.checkpoint_interval == 0 and steps != 0:
                    torch.save({"generator": generator.module.state_dict(), "mpd": mpd.module.state_dict(),
                                "msd": msd.module.state_dict(), "optim_g": optim_g.state_dict(),
                                "optim_d": optim_d.state_dict(), "steps": steps, "epoch": epoch},
                               ckpt_path + ".tmp")
                    os.replace(ckpt_path + ".tmp", ckpt_path)
                if steps % a.validation_interval == 0 and steps != 0:
                    gen = generator.module
                    gen.eval()
                    err, n = 0.0, 0
                    with torch.no_grad():
                        for j, (vmel, vy) in enumerate(valid_loader):
                            vhat = gen(vmel.to(device))
                            vhat_mel = mel_spectrogram(vhat.squeeze(1), h, fmax=h.fmax_for_loss)
                            vmel_ref = mel_spectrogram(vy.to(device), h, fmax=h.fmax_for_loss)
                            t = min(vhat_mel.size(-1), vmel_ref.size(-1))
                            err += F.l1_loss(vmel_ref[..., :t], vhat_mel[..., :t]).item()
                            n += 1
                            if j < 4:
                                sw.add_audio(f"gen/y_hat_{j}", vhat[0], steps, h.sampling_rate)
                    sw.add_scalar("validation/mel_spec_error", err / max(n, 1), steps)
                    gen.train()
            steps += 1
        sched_g.step()
        sched_d.step()
        if rank == 0:
            print(f"Time taken for epoch {epoch + 1} is {int(time.time() - start)} sec")

    if sw is not None:
        sw.close()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--input_training_file", default="filelists/train.txt")
    parser.add_argument("--input_validation_file", default="filelists/val.txt")
    parser.add_argument("--checkpoint_path", default="cp_hifigan")
    parser.add_argument("--config", default="config_v1.json")
    parser.add_argument("--training_epochs", type=int, default=3100)
    parser.add_argument("--stdout_interval", type=int, default=5)
    parser.add_argument("--checkpoint_interval", type=int, default=5000)
    parser.add_argument("--summary_interval", type=int, default=100)
    parser.add_argument("--validation_interval", type=int, default=1000)
    parser.add_argument("--port", type=int, default=54321)
    a = parser.parse_args()

    with open(a.config) as f:
        h = AttrDict(json.load(f))
    h.num_gpus = torch.cuda.device_count()
    h.batch_size = h.batch_size // h.num_gpus
    print(f"Batch size per GPU: {h.batch_size}")
    mp.spawn(train, nprocs=h.num_gpus, args=(a, h))


if __name__ == "__main__":
    main()
