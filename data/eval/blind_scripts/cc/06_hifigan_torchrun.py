"""HiFi-GAN (V1) training under torchrun, with optional fine-tuning on teacher-forced mels.

torchrun --nproc_per_node=8 06_hifigan_torchrun.py --config configs/v1.yaml --run_dir runs/hifigan_v1
"""
import argparse
import glob
import itertools
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from models.hifigan import Generator, MultiPeriodDiscriminator, MultiScaleDiscriminator


class MelExtractor(nn.Module):
    def __init__(self, c, fmax):
        super().__init__()
        self.n_fft, self.hop, self.win = c["n_fft"], c["hop_size"], c["win_size"]
        self.register_buffer("window", torch.hann_window(self.win))
        fb = torchaudio.functional.melscale_fbanks(self.n_fft // 2 + 1, c["fmin"], fmax or c["sampling_rate"] / 2,
                                                   c["num_mels"], c["sampling_rate"], norm="slaney", mel_scale="slaney")
        self.register_buffer("fb", fb.T)

    def forward(self, y):
        pad = (self.n_fft - self.hop) // 2
        y = F.pad(y.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
        spec = torch.stft(y, self.n_fft, self.hop, self.win, self.window, center=False, return_complex=True)
        mag = torch.sqrt(spec.real ** 2 + spec.imag ** 2 + 1e-9)
        return torch.log(torch.clamp(self.fb @ mag, min=1e-5))


class VocoderDataset(Dataset):
    def __init__(self, wavs, c, train=True, mel_dir=None):
        self.wavs, self.c, self.train, self.mel_dir = wavs, c, train, mel_dir
        self.extract = MelExtractor(c, c["fmax"])

    def __len__(self):
        return len(self.wavs)

    def __getitem__(self, i):
        wav, sr = torchaudio.load(self.wavs[i])
        assert sr == self.c["sampling_rate"]
        wav = 0.95 * wav[0] / wav.abs().max().clamp(min=1e-6)
        seg, hop = self.c["segment_size"], self.c["hop_size"]
        if self.mel_dir is None:
            if self.train:
                if wav.size(0) >= seg:
                    s = random.randint(0, wav.size(0) - seg)
                    wav = wav[s:s + seg]
                else:
                    wav = F.pad(wav, (0, seg - wav.size(0)))
            with torch.no_grad():
                mel = self.extract(wav[None])[0]
        else:
            name = os.path.splitext(os.path.basename(self.wavs[i]))[0]
            mel = torch.from_numpy(np.load(os.path.join(self.mel_dir, name + ".npy"))).float()
            if self.train:
                frames = seg // hop
                if mel.size(1) > frames:
                    s = random.randint(0, mel.size(1) - frames - 1)
                    mel, wav = mel[:, s:s + frames], wav[s * hop:(s + frames) * hop]
                else:
                    mel = F.pad(mel, (0, frames - mel.size(1)), value=float(np.log(1e-5)))
                    wav = F.pad(wav[:mel.size(1) * hop], (0, seg - min(wav.size(0), mel.size(1) * hop)))
        return mel, wav


def d_loss(real, fake):
    return sum(torch.mean((1 - r) ** 2) + torch.mean(f ** 2) for r, f in zip(real, fake))


def g_adv_loss(fake):
    return sum(torch.mean((1 - f) ** 2) for f in fake)


def fm_loss(fr, fg):
    return 2 * sum(F.l1_loss(g, r.detach()) for dr, dg in zip(fr, fg) for r, g in zip(dr, dg))


def latest(run_dir, prefix):
    cps = sorted(glob.glob(os.path.join(run_dir, f"{prefix}_*.pt")))
    return cps[-1] if cps else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--run_dir", required=True)
    ap.add_argument("--wav_dir", default="data/wavs")
    ap.add_argument("--train_list", default="data/train.txt")
    ap.add_argument("--val_list", default="data/val.txt")
    ap.add_argument("--mel_dir", default=None, help="teacher-forced mels for fine-tuning")
    ap.add_argument("--max_steps", type=int, default=2_500_000)
    args = ap.parse_args()
    with open(args.config) as f:
        c = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(c["seed"])
    torch.backends.cudnn.benchmark = True

    def read_list(p):
        with open(p) as f:
            return [os.path.join(args.wav_dir, l.split("|")[0] + ".wav") for l in f if l.strip()]

    train_ds = VocoderDataset(read_list(args.train_list), c, True, args.mel_dir)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=c["batch_size"], sampler=sampler, num_workers=c["num_workers"],
                          pin_memory=True, drop_last=True, persistent_workers=True)

    generator = Generator(c).to(device)
    mpd = MultiPeriodDiscriminator().to(device)
    msd = MultiScaleDiscriminator().to(device)
    loss_mel_fn = MelExtractor(c, None).to(device)

    optim_g = torch.optim.AdamW(generator.parameters(), c["learning_rate"], betas=(c["adam_b1"], c["adam_b2"]))
    optim_d = torch.optim.AdamW(itertools.chain(mpd.parameters(), msd.parameters()), c["learning_rate"],
                                betas=(c["adam_b1"], c["adam_b2"]))
    step, epoch = 0, 0
    cp_g, cp_d = latest(args.run_dir, "g"), latest(args.run_dir, "do")
    if cp_g is not None and cp_d is not None:
        sd_g = torch.load(cp_g, map_location=device)
        sd_d = torch.load(cp_d, map_location=device)
        generator.load_state_dict(sd_g["generator"])
        mpd.load_state_dict(sd_d["mpd"]); msd.load_state_dict(sd_d["msd"])
        optim_g.load_state_dict(sd_d["optim_g"]); optim_d.load_state_dict(sd_d["optim_d"])
        step, epoch = sd_d["steps"] + 1, sd_d["epoch"]
    sched_g = torch.optim.lr_scheduler.ExponentialLR(optim_g, c["lr_decay"], last_epoch=epoch - 1)
    sched_d = torch.optim.lr_scheduler.ExponentialLR(optim_d, c["lr_decay"], last_epoch=epoch - 1)

    generator = DDP(generator, device_ids=[local_rank])
    mpd = DDP(mpd, device_ids=[local_rank])
    msd = DDP(msd, device_ids=[local_rank])

    sw = None
    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)
        sw = SummaryWriter(os.path.join(args.run_dir, "logs"))
        val_ds = VocoderDataset(read_list(args.val_list), c, False, args.mel_dir)

    while step < args.max_steps:
        sampler.set_epoch(epoch)
        generator.train(); mpd.train(); msd.train()
        for mel, wav in train_dl:
            mel = mel.to(device, non_blocking=True)
            wav = wav.to(device, non_blocking=True).unsqueeze(1)

            wav_hat = generator(mel)
            mel_hat = loss_mel_fn(wav_hat.squeeze(1))
            mel_ref = loss_mel_fn(wav.squeeze(1))

            # discriminators
            optim_d.zero_grad(set_to_none=True)
            r_p, f_p, _, _ = mpd(wav, wav_hat.detach())
            r_s, f_s, _, _ = msd(wav, wav_hat.detach())
            loss_d = d_loss(r_p, f_p) + d_loss(r_s, f_s)
            loss_d.backward()
            optim_d.step()

            # generator
            optim_g.zero_grad(set_to_none=True)
            _, f_p, fm_r_p, fm_g_p = mpd(wav, wav_hat)
            _, f_s, fm_r_s, fm_g_s = msd(wav, wav_hat)
            loss_mel = F.l1_loss(mel_hat, mel_ref)
            loss_g = (g_adv_loss(f_p) + g_adv_loss(f_s) + fm_loss(fm_r_p, fm_g_p) + fm_loss(fm_r_s, fm_g_s)
                      + c["lambda_mel"] * loss_mel)
            loss_g.backward()
            optim_g.step()

            if step % c["log_interval"] == 0:
                stats = torch.stack([loss_g.detach(), loss_d.detach(), loss_mel.detach()])
                dist.all_reduce(stats, op=dist.ReduceOp.SUM)
                stats /= world
                if rank == 0:
                    print(f"step {step} | g {stats[0]:.3f} | d {stats[1]:.3f} | mel {stats[2]:.4f}")
                    for k, v in zip(("loss/g", "loss/d", "loss/mel"), stats.tolist()):
                        sw.add_scalar(k, v, step)

            if rank == 0 and step % c["checkpoint_interval"] == 0 and step > 0:
                torch.save({"generator": generator.module.state_dict()}, os.path.join(args.run_dir, f"g_{step:08d}.pt"))
                torch.save({"mpd": mpd.module.state_dict(), "msd": msd.module.state_dict(),
                            "optim_g": optim_g.state_dict(), "optim_d": optim_d.state_dict(),
                            "steps": step, "epoch": epoch}, os.path.join(args.run_dir, f"do_{step:08d}.pt"))
                # inference copy without weight norm, for the export folder
                export_g = Generator(c)
                export_g.load_state_dict(generator.module.state_dict())
                export_g.eval().remove_weight_norm()
                torch.save(export_g.state_dict(), os.path.join(args.run_dir, "generator_export.pt"))
                del export_g

            if step % c["validation_interval"] == 0:
                if rank == 0:
                    g = generator.module
                    g.eval()
                    err = 0.0
                    with torch.no_grad():
                        for j in range(len(val_ds)):
                            vmel, vwav = val_ds[j]
                            vhat = g(vmel[None].to(device)).squeeze(1)
                            vhat_mel = loss_mel_fn(vhat)
                            vref_mel = loss_mel_fn(vwav[None].to(device))
                            n = min(vhat_mel.size(-1), vref_mel.size(-1))
                            err += F.l1_loss(vhat_mel[..., :n], vref_mel[..., :n]).item()
                            if j < 4:
                                sw.add_audio(f"gen/{j}", vhat[0].clamp(-1, 1).cpu(), step, c["sampling_rate"])
                                if step == 0:
                                    sw.add_audio(f"gt/{j}", vwav.cpu(), step, c["sampling_rate"])
                    sw.add_scalar("val/mel_error", err / len(val_ds), step)
                    g.train()
                dist.barrier()

            step += 1
            if step >= args.max_steps:
                break
        sched_g.step(); sched_d.step()
        epoch += 1

    if sw is not None:
        sw.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
