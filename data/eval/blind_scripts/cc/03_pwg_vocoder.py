#!/usr/bin/env python3
# Parallel WaveGAN style vocoder: WaveNet-like generator + conv discriminator,
# multi-resolution STFT loss. Launch with torchrun.
import argparse
import glob
import logging
import os

import librosa
import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

logger = logging.getLogger("pwg")


def logmel(wav, cfg):
    S = np.abs(librosa.stft(wav, n_fft=cfg["fft_size"], hop_length=cfg["hop_size"],
                            win_length=cfg["win_length"], pad_mode="reflect"))
    mel_basis = librosa.filters.mel(sr=cfg["sampling_rate"], n_fft=cfg["fft_size"], n_mels=cfg["num_mels"],
                                    fmin=cfg["fmin"], fmax=cfg["fmax"])
    return np.log10(np.maximum(np.dot(mel_basis, S), 1e-10)).T.astype(np.float32)


def build_feature_cache(wav_files, dump_dir, cfg):
    """Compute log-mel for every wav, store it next to a trimmed copy of the audio, and compute mean/scale."""
    os.makedirs(dump_dir, exist_ok=True)
    sum_, sq_sum, n_frames = None, None, 0
    for path in wav_files:
        utt = os.path.splitext(os.path.basename(path))[0]
        wav, sr = sf.read(path)
        assert sr == cfg["sampling_rate"]
        wav, _ = librosa.effects.trim(wav, top_db=cfg["trim_threshold_in_db"])
        mel = logmel(wav, cfg)
        wav = np.pad(wav, (0, cfg["fft_size"]))[: len(mel) * cfg["hop_size"]].astype(np.float32)
        np.save(os.path.join(dump_dir, f"{utt}-wave.npy"), wav)
        np.save(os.path.join(dump_dir, f"{utt}-feats.npy"), mel)
        sum_ = mel.sum(0) if sum_ is None else sum_ + mel.sum(0)
        sq_sum = (mel ** 2).sum(0) if sq_sum is None else sq_sum + (mel ** 2).sum(0)
        n_frames += len(mel)
    mean = sum_ / n_frames
    scale = np.sqrt(np.maximum(sq_sum / n_frames - mean ** 2, 1e-8))
    np.save(os.path.join(dump_dir, "stats.npy"), np.stack([mean, scale]))


class AudioMelDataset(Dataset):
    def __init__(self, dump_dir, utts, cfg, stats):
        self.dump_dir, self.utts, self.cfg = dump_dir, utts, cfg
        self.mean, self.scale = stats
        self.batch_frames = cfg["batch_max_steps"] // cfg["hop_size"]

    def __len__(self):
        return len(self.utts)

    def __getitem__(self, i):
        utt = self.utts[i]
        wav = np.load(os.path.join(self.dump_dir, f"{utt}-wave.npy"))
        mel = (np.load(os.path.join(self.dump_dir, f"{utt}-feats.npy")) - self.mean) / self.scale
        hop = self.cfg["hop_size"]
        if len(mel) > self.batch_frames:
            start = np.random.randint(0, len(mel) - self.batch_frames)
            mel = mel[start:start + self.batch_frames]
            wav = wav[start * hop:(start + self.batch_frames) * hop]
        else:
            pad = self.batch_frames - len(mel)
            mel = np.pad(mel, ((0, pad), (0, 0)), mode="edge")
            wav = np.pad(wav, (0, pad * hop))
        return torch.from_numpy(mel.T.copy()), torch.from_numpy(wav).unsqueeze(0)


class ResidualBlock(nn.Module):
    def __init__(self, res_ch, gate_ch, skip_ch, aux_ch, dilation):
        super().__init__()
        self.conv = nn.Conv1d(res_ch, gate_ch, 3, padding=dilation, dilation=dilation)
        self.aux = nn.Conv1d(aux_ch, gate_ch, 1, bias=False)
        self.out = nn.Conv1d(gate_ch // 2, res_ch, 1)
        self.skip = nn.Conv1d(gate_ch // 2, skip_ch, 1)

    def forward(self, x, c):
        h = self.conv(F.dropout(x, 0.0, self.training)) + self.aux(c)
        a, b = h.chunk(2, dim=1)
        h = torch.tanh(a) * torch.sigmoid(b)
        return (self.out(h) + x) * (0.5 ** 0.5), self.skip(h)


class PWGGenerator(nn.Module):
    def __init__(self, aux_ch=80, layers=30, stacks=3, res_ch=64, gate_ch=128, skip_ch=64, hop=256):
        super().__init__()
        self.hop = hop
        self.first = nn.Conv1d(1, res_ch, 1)
        per_stack = layers // stacks
        self.blocks = nn.ModuleList([ResidualBlock(res_ch, gate_ch, skip_ch, aux_ch, 2 ** (l % per_stack))
                                     for l in range(layers)])
        self.upsample = nn.ModuleList()
        for s in (4, 4, 4, 4):
            self.upsample.append(nn.Conv2d(1, 1, (1, s * 2 + 1), padding=(0, s), bias=False))
        self.last = nn.Sequential(nn.ReLU(), nn.Conv1d(skip_ch, skip_ch, 1), nn.ReLU(), nn.Conv1d(skip_ch, 1, 1))

    def forward(self, z, c):
        c = c.unsqueeze(1)
        for up in self.upsample:
            c = up(F.interpolate(c, scale_factor=(1, 4), mode="nearest"))
        c = c.squeeze(1)[:, :, :z.size(-1)]
        x = self.first(z)
        skips = 0
        for blk in self.blocks:
            x, h = blk(x, c)
            skips = skips + h
        return self.last(skips * (1.0 / len(self.blocks)) ** 0.5)


class PWGDiscriminator(nn.Module):
    def __init__(self, layers=10, ch=64):
        super().__init__()
        convs, in_ch = [], 1
        for i in range(layers - 1):
            d = 1 if i == 0 else i
            convs += [nn.Conv1d(in_ch, ch, 3, padding=d, dilation=d), nn.LeakyReLU(0.2)]
            in_ch = ch
        convs.append(nn.Conv1d(in_ch, 1, 3, padding=1))
        self.net = nn.Sequential(*convs)
        for m in self.modules():
            if isinstance(m, nn.Conv1d):
                nn.utils.weight_norm(m)

    def forward(self, x):
        return self.net(x)


class MultiResolutionSTFTLoss(nn.Module):
    def __init__(self, resolutions=((1024, 120, 600), (2048, 240, 1200), (512, 50, 240))):
        super().__init__()
        self.resolutions = resolutions
        for i, (_, _, win) in enumerate(resolutions):
            self.register_buffer(f"window_{i}", torch.hann_window(win))

    def forward(self, y_hat, y):
        sc, mag = 0.0, 0.0
        for i, (n_fft, hop, win) in enumerate(self.resolutions):
            w = getattr(self, f"window_{i}")
            X = torch.stft(y_hat, n_fft, hop, win, w, return_complex=True).abs().clamp(min=1e-7)
            Y = torch.stft(y, n_fft, hop, win, w, return_complex=True).abs().clamp(min=1e-7)
            sc = sc + torch.norm(Y - X, p="fro") / torch.norm(Y, p="fro")
            mag = mag + F.l1_loss(torch.log(Y), torch.log(X))
        return sc / len(self.resolutions), mag / len(self.resolutions)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--wav_dir", required=True)
    ap.add_argument("--dump_dir", required=True)
    ap.add_argument("--outdir", required=True)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s (%(module)s:%(lineno)d) %(levelname)s: %(message)s")
    torch.manual_seed(cfg.get("seed", 1234))

    wav_files = sorted(glob.glob(os.path.join(args.wav_dir, "*.wav")))
    if not os.path.exists(os.path.join(args.dump_dir, "stats.npy")):
        logger.info(f"Extracting features for {len(wav_files)} files into {args.dump_dir}")
        build_feature_cache(wav_files, args.dump_dir, cfg)
    stats = np.load(os.path.join(args.dump_dir, "stats.npy"))
    utts = [os.path.splitext(os.path.basename(p))[0] for p in wav_files]
    dev_utts, train_utts = utts[:cfg["num_dev"]], utts[cfg["num_dev"]:]

    train_set = AudioMelDataset(args.dump_dir, train_utts, cfg, stats)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=sampler, drop_last=True,
                        num_workers=cfg["num_workers"], pin_memory=True)

    generator = PWGGenerator(aux_ch=cfg["num_mels"], hop=cfg["hop_size"]).to(device)
    discriminator = PWGDiscriminator().to(device)
    stft_loss = MultiResolutionSTFTLoss().to(device)
    opt_g = torch.optim.RAdam(generator.parameters(), lr=cfg["g_lr"], eps=1e-6)
    opt_d = torch.optim.RAdam(discriminator.parameters(), lr=cfg["d_lr"], eps=1e-6)
    sch_g = torch.optim.lr_scheduler.StepLR(opt_g, step_size=200000, gamma=0.5)
    sch_d = torch.optim.lr_scheduler.StepLR(opt_d, step_size=200000, gamma=0.5)

    steps, epoch = 0, 0
    if args.resume:
        state = torch.load(args.resume, map_location="cpu")
        generator.load_state_dict(state["model"]["generator"])
        discriminator.load_state_dict(state["model"]["discriminator"])
        opt_g.load_state_dict(state["optimizer"]["generator"])
        opt_d.load_state_dict(state["optimizer"]["discriminator"])
        sch_g.load_state_dict(state["scheduler"]["generator"])
        sch_d.load_state_dict(state["scheduler"]["discriminator"])
        steps, epoch = state["steps"], state["epochs"]
        logger.info(f"Resumed from {args.resume} at step {steps}")

    generator = DDP(generator, device_ids=[local_rank])
    discriminator = DDP(discriminator, device_ids=[local_rank])
    writer = SummaryWriter(args.outdir) if rank == 0 else None
    hop = cfg["hop_size"]

    while steps < cfg["train_max_steps"]:
        sampler.set_epoch(epoch)
        for mel, wav in loader:
            mel, wav = mel.to(device, non_blocking=True), wav.to(device, non_blocking=True)
            z = torch.randn(wav.size(0), 1, mel.size(-1) * hop, device=device)
            y_hat = generator(z, mel)
            sc, mag = stft_loss(y_hat.squeeze(1), wav.squeeze(1))
            g_loss = sc + mag
            if steps > cfg["discriminator_train_start_steps"]:
                adv = F.mse_loss(discriminator(y_hat), torch.ones_like(y_hat))
                g_loss = g_loss + cfg["lambda_adv"] * adv
            opt_g.zero_grad()
            g_loss.backward()
            nn.utils.clip_grad_norm_(generator.parameters(), cfg["grad_norm"])
            opt_g.step(); sch_g.step()

            if steps > cfg["discriminator_train_start_steps"]:
                p_real = discriminator(wav)
                p_fake = discriminator(y_hat.detach())
                d_loss = F.mse_loss(p_real, torch.ones_like(p_real)) + F.mse_loss(p_fake, torch.zeros_like(p_fake))
                opt_d.zero_grad()
                d_loss.backward()
                nn.utils.clip_grad_norm_(discriminator.parameters(), cfg["grad_norm"])
                opt_d.step(); sch_d.step()

            steps += 1
            if rank == 0 and steps % cfg["log_interval_steps"] == 0:
                writer.add_scalar("train/spectral_convergence_loss", sc.item(), steps)
                writer.add_scalar("train/log_stft_magnitude_loss", mag.item(), steps)
                writer.add_scalar("train/generator_loss", g_loss.item(), steps)
                logger.info(f"(steps: {steps}) generator_loss = {g_loss.item():.4f}")

            if rank == 0 and steps % cfg["eval_interval_steps"] == 0:
                g = generator.module.eval()
                with torch.no_grad():
                    for utt in dev_utts[:3]:
                        feat = (np.load(os.path.join(args.dump_dir, f"{utt}-feats.npy")) - stats[0]) / stats[1]
                        c = torch.from_numpy(feat.T).unsqueeze(0).to(device)
                        y = g(torch.randn(1, 1, c.size(-1) * hop, device=device), c).view(-1)
                        writer.add_audio(f"dev/{utt}", y.clamp(-1, 1).cpu(), steps, cfg["sampling_rate"])
                g.train()

            if rank == 0 and steps % cfg["save_interval_steps"] == 0:
                os.makedirs(args.outdir, exist_ok=True)
                torch.save({
                    "model": {"generator": generator.module.state_dict(),
                              "discriminator": discriminator.module.state_dict()},
                    "optimizer": {"generator": opt_g.state_dict(), "discriminator": opt_d.state_dict()},
                    "scheduler": {"generator": sch_g.state_dict(), "discriminator": sch_d.state_dict()},
                    "steps": steps, "epochs": epoch,
                }, os.path.join(args.outdir, f"checkpoint-{steps}steps.pkl"))
            if steps >= cfg["train_max_steps"]:
                break
        epoch += 1

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
