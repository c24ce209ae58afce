"""DDSP decoder (harmonic + filtered noise + reverb) for timbre transfer, trained on one instrument.

f0 (CREPE) and A-weighted loudness are precomputed by preprocess.py into <data>/{signals,pitchs,loudness}.npy,
together with mean/std of loudness in <data>/stats.yaml.

    torchrun --nproc_per_node=4 20_ddsp_timbre.py --data preprocessed/violin --name violin
"""
import argparse
import math
import os

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.fft as fft
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


class NpyDataset(Dataset):
    def __init__(self, path):
        self.signals = np.load(os.path.join(path, "signals.npy"), mmap_mode="r")
        self.pitchs = np.load(os.path.join(path, "pitchs.npy"), mmap_mode="r")
        self.loudness = np.load(os.path.join(path, "loudness.npy"), mmap_mode="r")

    def __len__(self):
        return self.signals.shape[0]

    def __getitem__(self, i):
        return (torch.from_numpy(np.array(self.signals[i], dtype=np.float32)),
                torch.from_numpy(np.array(self.pitchs[i], dtype=np.float32)),
                torch.from_numpy(np.array(self.loudness[i], dtype=np.float32)))


def mlp(in_size, hidden, n_layers):
    layers = []
    for i in range(n_layers):
        layers += [nn.Linear(in_size if i == 0 else hidden, hidden), nn.LayerNorm(hidden), nn.LeakyReLU()]
    return nn.Sequential(*layers)


def scale_function(x):
    return 2 * torch.sigmoid(x) ** math.log(10) + 1e-7


def upsample(signal, factor):
    return F.interpolate(signal.permute(0, 2, 1), size=signal.shape[1] * factor).permute(0, 2, 1)


def remove_above_nyquist(amplitudes, pitch, sr):
    n = amplitudes.shape[-1]
    pitches = pitch * torch.arange(1, n + 1, device=pitch.device)
    return amplitudes * (pitches < sr / 2).float() + 1e-4


def harmonic_synth(pitch, amplitudes, sr):
    n_harmonic = amplitudes.shape[-1]
    omega = torch.cumsum(2 * math.pi * pitch / sr, 1)
    omegas = omega * torch.arange(1, n_harmonic + 1, device=omega.device)
    return (torch.sin(omegas) * amplitudes).sum(-1, keepdim=True)


def amp_to_impulse_response(amp, target_size):
    amp = torch.stack([amp, torch.zeros_like(amp)], -1)
    amp = torch.view_as_complex(amp)
    amp = fft.irfft(amp)
    filter_size = amp.shape[-1]
    amp = torch.roll(amp, filter_size // 2, -1)
    win = torch.hann_window(filter_size, dtype=amp.dtype, device=amp.device)
    amp = amp * win
    amp = F.pad(amp, (0, int(target_size) - int(filter_size)))
    return torch.roll(amp, -filter_size // 2, -1)


def fft_convolve(signal, kernel):
    signal = F.pad(signal, (0, signal.shape[-1]))
    kernel = F.pad(kernel, (kernel.shape[-1], 0))
    output = fft.irfft(fft.rfft(signal) * fft.rfft(kernel))
    return output[..., output.shape[-1] // 2:]


class Reverb(nn.Module):
    def __init__(self, length, sr):
        super().__init__()
        self.length, self.sr = length, sr
        self.noise = nn.Parameter((torch.rand(length) * 2 - 1).unsqueeze(-1))
        self.decay = nn.Parameter(torch.tensor(float(5)))
        self.wet = nn.Parameter(torch.tensor(float(0)))
        self.register_buffer("t", (torch.arange(length) / sr).reshape(1, -1, 1))

    def forward(self, x):
        lenx = x.shape[1]
        impulse = self.noise * torch.exp(-F.softplus(-self.decay) * self.t * 500) * torch.sigmoid(self.wet)
        impulse = impulse.clone()
        impulse[:, 0] = 1
        impulse = F.pad(impulse, (0, 0, 0, lenx - self.length))
        return fft_convolve(x.squeeze(-1), impulse.squeeze(-1)).unsqueeze(-1)


class DDSP(nn.Module):
    def __init__(self, hidden_size, n_harmonic, n_bands, sampling_rate, block_size):
        super().__init__()
        self.sampling_rate, self.block_size = sampling_rate, block_size
        self.in_mlps = nn.ModuleList([mlp(1, hidden_size, 3), mlp(1, hidden_size, 3)])
        self.gru = nn.GRU(2 * hidden_size, hidden_size, batch_first=True)
        self.out_mlp = mlp(hidden_size + 2, hidden_size, 3)
        self.proj_harm = nn.Linear(hidden_size, n_harmonic + 1)
        self.proj_noise = nn.Linear(hidden_size, n_bands)
        self.reverb = Reverb(sampling_rate, sampling_rate)

    def forward(self, pitch, loudness):
        hidden = torch.cat([self.in_mlps[0](pitch), self.in_mlps[1](loudness)], -1)
        hidden = torch.cat([self.gru(hidden)[0], pitch, loudness], -1)
        hidden = self.out_mlp(hidden)
        param = scale_function(self.proj_harm(hidden))
        total_amp, amplitudes = param[..., :1], param[..., 1:]
        amplitudes = remove_above_nyquist(amplitudes, pitch, self.sampling_rate)
        amplitudes = amplitudes / amplitudes.sum(-1, keepdim=True) * total_amp
        amplitudes = upsample(amplitudes, self.block_size)
        pitch_up = upsample(pitch, self.block_size)
        harmonic = harmonic_synth(pitch_up, amplitudes, self.sampling_rate)
        param = scale_function(self.proj_noise(hidden) - 5)
        impulse = amp_to_impulse_response(param, self.block_size)
        noise = torch.rand(impulse.shape[0], impulse.shape[1], self.block_size, device=impulse.device) * 2 - 1
        noise = fft_convolve(noise, impulse).contiguous().reshape(noise.shape[0], -1, 1)
        return self.reverb(harmonic + noise)


def multiscale_fft(signal, scales, overlap=0.75):
    stfts = []
    for s in scales:
        S = torch.stft(signal, s, int(s * (1 - overlap)), s, torch.hann_window(s, device=signal.device),
                       center=True, normalized=True, return_complex=True).abs()
        stfts.append(S)
    return stfts


def safe_log(x):
    return torch.log(x + 1e-7)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--root", default="runs")
    ap.add_argument("--steps", type=int, default=500_000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--start_lr", type=float, default=1e-3)
    ap.add_argument("--stop_lr", type=float, default=1e-4)
    ap.add_argument("--decay_over", type=int, default=400_000)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--n_harmonic", type=int, default=100)
    ap.add_argument("--n_bands", type=int, default=65)
    ap.add_argument("--sr", type=int, default=16000)
    ap.add_argument("--block_size", type=int, default=160)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(os.path.join(args.data, "stats.yaml")) as f:
        stats = yaml.safe_load(f)
    mean_loudness, std_loudness = stats["mean_loudness"], stats["std_loudness"]
    scales = [4096, 2048, 1024, 512, 256, 128]

    dataset = NpyDataset(args.data)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, args.batch, sampler=sampler, drop_last=True, num_workers=4, pin_memory=True)

    model = DDSP(args.hidden, args.n_harmonic, args.n_bands, args.sr, args.block_size).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.start_lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: max(args.stop_lr / args.start_lr, (args.stop_lr / args.start_lr) ** (s / args.decay_over)))

    out_dir = os.path.join(args.root, args.name)
    writer = None
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump({**vars(args), **stats}, f)
        writer = SummaryWriter(out_dir, flush_secs=20)

    step, epoch, best_loss = 0, 0, float("inf")
    n_epochs = int(np.ceil(args.steps / len(loader)))
    for epoch in range(n_epochs):
        sampler.set_epoch(epoch)
        running, n_batches = 0.0, 0
        for s, p, l in loader:
            s, p, l = s.to(device, non_blocking=True), p.unsqueeze(-1).to(device), l.unsqueeze(-1).to(device)
            l = (l - mean_loudness) / std_loudness
            y = model(p, l).squeeze(-1)
            ori_stft = multiscale_fft(s, scales)
            rec_stft = multiscale_fft(y, scales)
            loss = 0.0
            for s_x, s_y in zip(ori_stft, rec_stft):
                loss = loss + (s_x - s_y).abs().mean() + (safe_log(s_x) - safe_log(s_y)).abs().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            running += loss.item()
            n_batches += 1
            if rank == 0 and step % 100 == 0:
                writer.add_scalar("loss", loss.item(), step)
                writer.add_scalar("lr", sched.get_last_lr()[0], step)
                writer.add_scalar("reverb_decay", model.module.reverb.decay.item(), step)
                writer.add_scalar("reverb_wet", model.module.reverb.wet.item(), step)

        mean_loss = torch.tensor([running / max(n_batches, 1)])
        dist.all_reduce(mean_loss)
        mean_loss = mean_loss.item() / world

        if rank == 0:
            writer.add_scalar("epoch_loss", mean_loss, epoch)
            if mean_loss < best_loss:
                best_loss = mean_loss
                torch.save(model.module.state_dict(), os.path.join(out_dir, "state.pth"))
            if epoch % 10 == 0:
                audio = torch.cat([s, y], -1).reshape(-1).detach().cpu().numpy()
                sf.write(os.path.join(out_dir, f"eval_{epoch:06d}.wav"), audio, args.sr)
                writer.add_audio("reconstruction", torch.from_numpy(audio), epoch, args.sr)
        if step >= args.steps:
            break

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
