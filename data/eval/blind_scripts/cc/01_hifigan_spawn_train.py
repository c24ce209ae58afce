import argparse
import itertools
import json
import os
import random
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import remove_weight_norm, spectral_norm, weight_norm
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

LRELU_SLOPE = 0.1
MAX_WAV_VALUE = 32768.0


class AttrDict(dict):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.__dict__ = self


_mel_basis = {}
_hann_window = {}


def mel_spectrogram(y, n_fft, num_mels, sr, hop_size, win_size, fmin, fmax):
    import librosa

    key = f"{fmax}_{y.device}"
    if key not in _mel_basis:
        mel = librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=num_mels, fmin=fmin, fmax=fmax)
        _mel_basis[key] = torch.from_numpy(mel).float().to(y.device)
        _hann_window[str(y.device)] = torch.hann_window(win_size).to(y.device)
    pad = int((n_fft - hop_size) / 2)
    y = F.pad(y.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    spec = torch.stft(y, n_fft, hop_length=hop_size, win_length=win_size,
                      window=_hann_window[str(y.device)], center=False, return_complex=True)
    spec = torch.sqrt(spec.real.pow(2) + spec.imag.pow(2) + 1e-9)
    spec = torch.matmul(_mel_basis[key], spec)
    return torch.log(torch.clamp(spec, min=1e-5))


class MelDataset(Dataset):
    def __init__(self, files, h, split=True):
        self.files = files
        self.h = h
        self.split = split

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        audio, sr = sf.read(self.files[idx], dtype="int16")
        assert sr == self.h.sampling_rate, f"{sr} != {self.h.sampling_rate}"
        audio = torch.FloatTensor(audio / MAX_WAV_VALUE).unsqueeze(0)
        if self.split:
            seg = self.h.segment_size
            if audio.size(1) >= seg:
                start = random.randint(0, audio.size(1) - seg)
                audio = audio[:, start:start + seg]
            else:
                audio = F.pad(audio, (0, seg - audio.size(1)))
        mel = mel_spectrogram(audio, self.h.n_fft, self.h.num_mels, self.h.sampling_rate,
                              self.h.hop_size, self.h.win_size, self.h.fmin, self.h.fmax)
        mel_loss = mel_spectrogram(audio, self.h.n_fft, self.h.num_mels, self.h.sampling_rate,
                                   self.h.hop_size, self.h.win_size, self.h.fmin, None)
        return mel.squeeze(0), audio.squeeze(0), mel_loss.squeeze(0)


class ResBlock(nn.Module):
    def __init__(self, ch, k=3, dilation=(1, 3, 5)):
        super().__init__()
        self.convs1 = nn.ModuleList([weight_norm(nn.Conv1d(ch, ch, k, 1, dilation=d, padding=d * (k - 1) // 2))
                                     for d in dilation])
        self.convs2 = nn.ModuleList([weight_norm(nn.Conv1d(ch, ch, k, 1, padding=(k - 1) // 2))
                                     for _ in dilation])

    def forward(self, x):
        for c1, c2 in zip(self.convs1, self.convs2):
            xt = c2(F.leaky_relu(c1(F.leaky_relu(x, LRELU_SLOPE)), LRELU_SLOPE))
            x = xt + x
        return x

    def remove_weight_norm(self):
        for l in itertools.chain(self.convs1, self.convs2):
            remove_weight_norm(l)


class Generator(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.num_kernels = len(h.resblock_kernel_sizes)
        self.conv_pre = weight_norm(nn.Conv1d(h.num_mels, h.upsample_initial_channel, 7, 1, padding=3))
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        ch = h.upsample_initial_channel
        for i, (u, k) in enumerate(zip(h.upsample_rates, h.upsample_kernel_sizes)):
            self.ups.append(weight_norm(nn.ConvTranspose1d(ch // (2 ** i), ch // (2 ** (i + 1)),
                                                           k, u, padding=(k - u) // 2)))
            for rk, rd in zip(h.resblock_kernel_sizes, h.resblock_dilation_sizes):
                self.resblocks.append(ResBlock(ch // (2 ** (i + 1)), rk, rd))
        self.conv_post = weight_norm(nn.Conv1d(ch // (2 ** len(self.ups)), 1, 7, 1, padding=3))

    def forward(self, x):
        x = self.conv_pre(x)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, LRELU_SLOPE))
            xs = sum(self.resblocks[i * self.num_kernels + j](x) for j in range(self.num_kernels))
            x = xs / self.num_kernels
        return torch.tanh(self.conv_post(F.leaky_relu(x)))


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
        if t % self.period != 0:
            n_pad = self.period - (t % self.period)
            x = F.pad(x, (0, n_pad), "reflect")
            t = t + n_pad
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


class MultiDiscriminator(nn.Module):
    def __init__(self, discs, pools=None):
        super().__init__()
        self.discriminators = nn.ModuleList(discs)
        self.pools = nn.ModuleList(pools) if pools is not None else None

    def forward(self, y, y_hat):
        y_d_rs, y_d_gs, fmap_rs, fmap_gs = [], [], [], []
        for i, d in enumerate(self.discriminators):
            if self.pools is not None and i > 0:
                y = self.pools[i - 1](y)
                y_hat = self.pools[i - 1](y_hat)
            y_d_r, fmap_r = d(y)
            y_d_g, fmap_g = d(y_hat)
            y_d_rs.append(y_d_r); fmap_rs.append(fmap_r)
            y_d_gs.append(y_d_g); fmap_gs.append(fmap_g)
        return y_d_rs, y_d_gs, fmap_rs, fmap_gs


def feature_loss(fmap_r, fmap_g):
    return 2 * sum(torch.mean(torch.abs(rl - gl)) for dr, dg in zip(fmap_r, fmap_g) for rl, gl in zip(dr, dg))


def discriminator_loss(d_real, d_gen):
    return sum(torch.mean((1 - dr) ** 2) + torch.mean(dg ** 2) for dr, dg in zip(d_real, d_gen))


def generator_loss(d_gen):
    return sum(torch.mean((1 - dg) ** 2) for dg in d_gen)


def load_filelist(path, wav_dir):
    with open(path, encoding="utf-8") as f:
        return [os.path.join(wav_dir, line.split("|")[0] + ".wav") for line in f if line.strip()]


def train(rank, a, h):
    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    if h.num_gpus > 1:
        dist.init_process_group(backend=h.dist_config["dist_backend"], init_method=h.dist_config["dist_url"],
                                world_size=h.dist_config["world_size"] * h.num_gpus, rank=rank)
    torch.cuda.manual_seed(h.seed)

    generator = Generator(h).to(device)
    mpd = MultiDiscriminator([DiscriminatorP(p) for p in (2, 3, 5, 7, 11)]).to(device)
    msd = MultiDiscriminator([DiscriminatorS(True), DiscriminatorS(), DiscriminatorS()],
                             [nn.AvgPool1d(4, 2, padding=2), nn.AvgPool1d(4, 2, padding=2)]).to(device)

    steps, last_epoch = 0, -1
    ckpt_g = os.path.join(a.checkpoint_path, "g_latest")
    ckpt_do = os.path.join(a.checkpoint_path, "do_latest")
    state_do = None
    if os.path.isfile(ckpt_g) and os.path.isfile(ckpt_do):
        generator.load_state_dict(torch.load(ckpt_g, map_location=device)["generator"])
        state_do = torch.load(ckpt_do, map_location=device)
        mpd.load_state_dict(state_do["mpd"])
        msd.load_state_dict(state_do["msd"])
        steps, last_epoch = state_do["steps"] + 1, state_do["epoch"]

    if h.num_gpus > 1:
        generator = DistributedDataParallel(generator, device_ids=[rank])
        mpd = DistributedDataParallel(mpd, device_ids=[rank])
        msd = DistributedDataParallel(msd, device_ids=[rank])

    optim_g = torch.optim.AdamW(generator.parameters(), h.learning_rate, betas=[h.adam_b1, h.adam_b2])
    optim_d = torch.optim.AdamW(itertools.chain(msd.parameters(), mpd.parameters()),
                                h.learning_rate, betas=[h.adam_b1, h.adam_b2])
    if state_do is not None:
        optim_g.load_state_dict(state_do["optim_g"])
        optim_d.load_state_dict(state_do["optim_d"])
    sched_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, gamma=h.lr_decay, last_epoch=last_epoch)
    sched_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, gamma=h.lr_decay, last_epoch=last_epoch)

    train_set = MelDataset(load_filelist(a.input_training_file, a.input_wavs_dir), h)
    sampler = DistributedSampler(train_set) if h.num_gpus > 1 else None
    train_loader = DataLoader(train_set, num_workers=h.num_workers, shuffle=sampler is None, sampler=sampler,
                              batch_size=h.batch_size, pin_memory=True, drop_last=True)

    if rank == 0:
        val_set = MelDataset(load_filelist(a.input_validation_file, a.input_wavs_dir), h, split=False)
        val_loader = DataLoader(val_set, num_workers=1, batch_size=1, pin_memory=True)
        sw = SummaryWriter(os.path.join(a.checkpoint_path, "logs"))

    generator.train(); mpd.train(); msd.train()
    for epoch in range(max(0, last_epoch), a.training_epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        start = time.time()
        for x, y, y_mel in train_loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True).unsqueeze(1)
            y_mel = y_mel.to(device, non_blocking=True)

            y_g_hat = generator(x)
            y_g_hat_mel = mel_spectrogram(y_g_hat.squeeze(1), h.n_fft, h.num_mels, h.sampling_rate,
                                          h.hop_size, h.win_size, h.fmin, None)

            optim_d.zero_grad()
            y_df_r, y_df_g, _, _ = mpd(y, y_g_hat.detach())
            y_ds_r, y_ds_g, _, _ = msd(y, y_g_hat.detach())
            loss_disc = discriminator_loss(y_df_r, y_df_g) + discriminator_loss(y_ds_r, y_ds_g)
            loss_disc.backward()
            optim_d.step()

            optim_g.zero_grad()
            loss_mel = F.l1_loss(y_mel, y_g_hat_mel) * 45
            _, y_df_g, fmap_f_r, fmap_f_g = mpd(y, y_g_hat)
            _, y_ds_g, fmap_s_r, fmap_s_g = msd(y, y_g_hat)
            loss_gen_all = (generator_loss(y_df_g) + generator_loss(y_ds_g) +
                            feature_loss(fmap_f_r, fmap_f_g) + feature_loss(fmap_s_r, fmap_s_g) + loss_mel)
            loss_gen_all.backward()
            optim_g.step()

            if rank == 0:
                if steps % a.stdout_interval == 0:
                    print(f"Steps: {steps}, Gen Loss Total: {loss_gen_all.item():4.3f}, "
                          f"Mel-Spec. Error: {loss_mel.item() / 45:4.3f}")
                if steps % a.summary_interval == 0:
                    sw.add_scalar("training/gen_loss_total", loss_gen_all.item(), steps)
                    sw.add_scalar("training/mel_spec_error", loss_mel.item() / 45, steps)
                if steps % a.checkpoint_interval == 0 and steps != 0:
                    g = generator.module if h.num_gpus > 1 else generator
                    torch.save({"generator": g.state_dict()}, ckpt_g)
                    torch.save({"mpd": (mpd.module if h.num_gpus > 1 else mpd).state_dict(),
                                "msd": (msd.module if h.num_gpus > 1 else msd).state_dict(),
                                "optim_g": optim_g.state_dict(), "optim_d": optim_d.state_dict(),
                                "steps": steps, "epoch": epoch}, ckpt_do)
                if steps % a.validation_interval == 0:
                    g = generator.module if h.num_gpus > 1 else generator
                    g.eval()
                    val_err = 0.0
                    with torch.no_grad():
                        for j, (vx, vy, vmel) in enumerate(val_loader):
                            vy_hat = g(vx.to(device))
                            vy_hat_mel = mel_spectrogram(vy_hat.squeeze(1), h.n_fft, h.num_mels, h.sampling_rate,
                                                         h.hop_size, h.win_size, h.fmin, None)
                            n = min(vmel.size(-1), vy_hat_mel.size(-1))
                            val_err += F.l1_loss(vmel.to(device)[..., :n], vy_hat_mel[..., :n]).item()
                            if j < 4:
                                sw.add_audio(f"generated/y_hat_{j}", vy_hat[0], steps, h.sampling_rate)
                    sw.add_scalar("validation/mel_spec_error", val_err / max(1, len(val_loader)), steps)
                    g.train()
            steps += 1
        sched_g.step()
        sched_d.step()
        if rank == 0:
            print(f"Time taken for epoch {epoch + 1} is {int(time.time() - start)} sec")

    if h.num_gpus > 1:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--input_wavs_dir", default="LJSpeech-1.1/wavs")
    parser.add_argument("--input_training_file", default="LJSpeech-1.1/training.txt")
    parser.add_argument("--input_validation_file", default="LJSpeech-1.1/validation.txt")
    parser.add_argument("--checkpoint_path", default="cp_hifigan")
    parser.add_argument("--config", default="config_v1.json")
    parser.add_argument("--training_epochs", default=3100, type=int)
    parser.add_argument("--stdout_interval", default=5, type=int)
    parser.add_argument("--checkpoint_interval", default=5000, type=int)
    parser.add_argument("--summary_interval", default=100, type=int)
    parser.add_argument("--validation_interval", default=1000, type=int)
    a = parser.parse_args()

    with open(a.config) as f:
        h = AttrDict(json.load(f))
    os.makedirs(a.checkpoint_path, exist_ok=True)

    torch.manual_seed(h.seed)
    np.random.seed(h.seed)
    h.num_gpus = torch.cuda.device_count()
    h.batch_size = int(h.batch_size / h.num_gpus)
    print("Batch size per GPU :", h.batch_size)

    if h.num_gpus > 1:
        mp.spawn(train, nprocs=h.num_gpus, args=(h, a))
    else:
        train(0, a, h)


if __name__ == "__main__":
    main()
