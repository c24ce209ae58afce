#!/usr/bin/env python3
"""EnCodec-style 24 kHz codec: SEANet encoder/decoder, RVQ with quantizer dropout,
multi-scale STFT discriminator, multi-scale mel reconstruction loss.

torchrun --standalone --nproc_per_node=8 02_encodec_gan_codec.py --config configs/codec24k.yaml
"""
import argparse
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import weight_norm
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


# ----------------------------------------------------------------------------- data
class WavCrops(Dataset):
    def __init__(self, manifest, sample_rate, segment):
        with open(manifest) as f:
            self.paths = [l.strip() for l in f if l.strip()]
        self.sr, self.segment = sample_rate, segment

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        info = torchaudio.info(self.paths[i])
        n_src = int(self.segment * info.sample_rate / self.sr) + 1
        off = random.randint(0, max(0, info.num_frames - n_src))
        wav, sr = torchaudio.load(self.paths[i], frame_offset=off, num_frames=n_src)
        wav = torchaudio.functional.resample(wav.mean(0, keepdim=True), sr, self.sr)
        wav = F.pad(wav, (0, max(0, self.segment - wav.shape[-1])))[:, : self.segment]
        gain = 10 ** (random.uniform(-6, 0) / 20)  # mild loudness augmentation
        return wav * gain / wav.abs().max().clamp(min=1e-4) * 0.95


# ---------------------------------------------------------------------------- model
class ResUnit(nn.Module):
    def __init__(self, ch, dilation):
        super().__init__()
        self.net = nn.Sequential(
            nn.ELU(), nn.Conv1d(ch, ch // 2, 3, dilation=dilation, padding=dilation),
            nn.ELU(), nn.Conv1d(ch // 2, ch, 1),
        )

    def forward(self, x):
        return x + self.net(x)


def seanet_encoder(ch, dim, strides):
    layers = [nn.Conv1d(1, ch, 7, padding=3)]
    for s in strides:
        layers += [ResUnit(ch, 1), ResUnit(ch, 3), ResUnit(ch, 9), nn.ELU(),
                   nn.Conv1d(ch, ch * 2, 2 * s, stride=s, padding=math.ceil(s / 2))]
        ch *= 2
    layers += [nn.ELU(), nn.Conv1d(ch, dim, 7, padding=3)]
    return nn.Sequential(*layers)


def seanet_decoder(ch, dim, strides):
    ch = ch * 2 ** len(strides)
    layers = [nn.Conv1d(dim, ch, 7, padding=3)]
    for s in reversed(strides):
        layers += [nn.ELU(), nn.ConvTranspose1d(ch, ch // 2, 2 * s, stride=s,
                                                padding=s // 2 + s % 2, output_padding=s % 2)]
        ch //= 2
        layers += [ResUnit(ch, 1), ResUnit(ch, 3), ResUnit(ch, 9)]
    layers += [nn.ELU(), nn.Conv1d(ch, 1, 7, padding=3), nn.Tanh()]
    return nn.Sequential(*layers)


class VQ(nn.Module):
    def __init__(self, dim, bins):
        super().__init__()
        self.codebook = nn.Embedding(bins, dim)
        self.codebook.weight.data.uniform_(-1.0 / bins, 1.0 / bins)

    def forward(self, x):  # [B, D, T]
        flat = x.transpose(1, 2).reshape(-1, x.shape[1])
        d2 = flat.pow(2).sum(1, keepdim=True) - 2 * flat @ self.codebook.weight.t() \
            + self.codebook.weight.pow(2).sum(1)[None]
        idx = d2.argmin(1)
        q = self.codebook(idx).view(x.shape[0], x.shape[2], -1).transpose(1, 2)
        loss = F.mse_loss(q, x.detach()) + 0.25 * F.mse_loss(x, q.detach())
        return x + (q - x).detach(), idx.view(x.shape[0], -1), loss


class ResidualVQ(nn.Module):
    def __init__(self, n_q, dim, bins):
        super().__init__()
        self.n_q = n_q
        self.layers = nn.ModuleList(VQ(dim, bins) for _ in range(n_q))

    def forward(self, x, n_q=None):
        n_q = n_q or self.n_q
        residual, out, loss, codes = x, 0.0, 0.0, []
        for layer in self.layers[:n_q]:
            q, idx, l = layer(residual)
            residual = residual - q.detach()
            out, loss = out + q, loss + l
            codes.append(idx)
        return out, torch.stack(codes, 1), loss / n_q


class Codec(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.encoder = seanet_encoder(cfg["channels"], cfg["dim"], cfg["strides"])
        self.quantizer = ResidualVQ(cfg["n_q"], cfg["dim"], cfg["bins"])
        self.decoder = seanet_decoder(cfg["channels"], cfg["dim"], cfg["strides"])

    def forward(self, wav, n_q=None):
        z = self.encoder(wav)
        zq, codes, vq_loss = self.quantizer(z, n_q)
        return self.decoder(zq)[..., : wav.shape[-1]], codes, vq_loss


class STFTDisc(nn.Module):
    def __init__(self, n_fft, ch=32):
        super().__init__()
        self.n_fft = n_fft
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        self.convs = nn.ModuleList([
            weight_norm(nn.Conv2d(2, ch, (3, 9), padding=(1, 4))),
            weight_norm(nn.Conv2d(ch, ch, (3, 9), stride=(1, 2), padding=(1, 4))),
            weight_norm(nn.Conv2d(ch, ch, (3, 9), stride=(1, 2), padding=(1, 4))),
            weight_norm(nn.Conv2d(ch, ch, (3, 3), padding=(1, 1))),
        ])
        self.post = weight_norm(nn.Conv2d(ch, 1, (3, 3), padding=(1, 1)))

    def forward(self, x):
        spec = torch.stft(x.squeeze(1), self.n_fft, self.n_fft // 4, window=self.window, return_complex=True)
        z = torch.stack([spec.real, spec.imag], 1).transpose(2, 3)
        fmaps = []
        for conv in self.convs:
            z = F.leaky_relu(conv(z), 0.2)
            fmaps.append(z)
        return self.post(z), fmaps


class MultiScaleSTFTDisc(nn.Module):
    def __init__(self, n_ffts=(2048, 1024, 512, 256, 128)):
        super().__init__()
        self.discs = nn.ModuleList(STFTDisc(n) for n in n_ffts)

    def forward(self, x):
        return [d(x) for d in self.discs]


class MelLoss(nn.Module):
    def __init__(self, sr, scales=(6, 7, 8, 9, 10, 11)):
        super().__init__()
        self.mels = nn.ModuleList(
            torchaudio.transforms.MelSpectrogram(sr, n_fft=2 ** i, hop_length=2 ** i // 4,
                                                 n_mels=min(64, 2 ** (i - 2)), power=1.0)
            for i in scales
        )

    def forward(self, x, y):
        loss = 0.0
        for m in self.mels:
            mx, my = m(x), m(y)
            loss = loss + F.l1_loss(mx, my) + F.mse_loss(mx.clamp(min=1e-5).log(), my.clamp(min=1e-5).log())
        return loss / len(self.mels)


# ----------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    random.seed(cfg["seed"] + rank)
    torch.manual_seed(cfg["seed"] + rank)

    sr, segment = cfg["sample_rate"], int(cfg["segment_seconds"] * cfg["sample_rate"])
    dataset = WavCrops(cfg["train_manifest"], sr, segment)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=cfg["batch_size"] // world, sampler=sampler,
                        num_workers=cfg.get("num_workers", 8), pin_memory=True, drop_last=True)

    codec = Codec(cfg["model"]).to(device)
    disc = MultiScaleSTFTDisc().to(device)
    # Quantizer dropout leaves the upper codebooks untouched on most steps.
    codec = DDP(codec, device_ids=[local_rank], find_unused_parameters=True)
    disc = DDP(disc, device_ids=[local_rank])
    mel_loss = MelLoss(sr).to(device)

    opt_g = torch.optim.Adam(codec.parameters(), lr=cfg["lr"], betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(disc.parameters(), lr=cfg["lr"], betas=(0.5, 0.9))

    step = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        codec.module.load_state_dict(ckpt["codec"])
        disc.module.load_state_dict(ckpt["disc"])
        opt_g.load_state_dict(ckpt["opt_g"])
        opt_d.load_state_dict(ckpt["opt_d"])
        step = ckpt["step"]

    writer = SummaryWriter(cfg["log_dir"]) if rank == 0 else None
    n_q_max = codec.module.quantizer.n_q
    bandwidth_nq = cfg.get("train_nq", [2, 4, 8, n_q_max])
    epoch = step // len(loader)
    t0 = time.time()

    while step < cfg["max_steps"]:
        sampler.set_epoch(epoch)
        for real in loader:
            real = real.to(device, non_blocking=True)
            n_q = random.choice(bandwidth_nq)
            fake, _, vq_loss = codec(real, n_q=n_q)

            use_adv = step >= cfg["disc_start"]
            if use_adv:
                # discriminator step: real and fake in one forward
                logits = disc(torch.cat([real, fake.detach()]))
                d_loss = 0.0
                for lg, _ in logits:
                    lr_, lf_ = lg.chunk(2)
                    d_loss = d_loss + F.relu(1 - lr_).mean() + F.relu(1 + lf_).mean()
                d_loss = d_loss / len(logits)
                opt_d.zero_grad(set_to_none=True)
                d_loss.backward()
                opt_d.step()

            rec = mel_loss(fake, real) + F.l1_loss(fake, real)
            g_loss = cfg["w_rec"] * rec + cfg["w_vq"] * vq_loss
            adv = fm = torch.zeros((), device=device)
            if use_adv:
                outs = disc(torch.cat([real, fake]))
                for lg, fmaps in outs:
                    adv = adv + F.relu(1 - lg.chunk(2)[1]).mean()
                    for fmap in fmaps:
                        fr, ff = fmap.chunk(2)
                        fm = fm + F.l1_loss(ff, fr.detach()) / fr.detach().abs().mean().clamp(min=1e-5)
                adv, fm = adv / len(outs), fm / (len(outs) * len(outs[0][1]))
                g_loss = g_loss + cfg["w_adv"] * adv + cfg["w_fm"] * fm
            opt_g.zero_grad(set_to_none=True)
            g_loss.backward()
            torch.nn.utils.clip_grad_norm_(codec.parameters(), cfg.get("grad_clip", 1000.0))
            opt_g.step()
            step += 1

            if step % cfg["log_every"] == 0:
                stats = torch.stack([rec.detach(), vq_loss.detach(), adv.detach(), fm.detach()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    for k, v in zip(["rec", "vq", "adv", "fm"], stats.tolist()):
                        writer.add_scalar(f"train/{k}", v, step)
                    print(f"[{step}] rec={stats[0]:.3f} vq={stats[1]:.3f} adv={stats[2]:.3f} "
                          f"fm={stats[3]:.3f} ({time.time() - t0:.1f}s)", flush=True)
                    t0 = time.time()

            if step % cfg["save_every"] == 0:
                if rank == 0:
                    os.makedirs(cfg["ckpt_dir"], exist_ok=True)
                    tmp = os.path.join(cfg["ckpt_dir"], f"ckpt_{step:08d}.pt.tmp")
                    torch.save({"codec": codec.module.state_dict(), "disc": disc.module.state_dict(),
                                "opt_g": opt_g.state_dict(), "opt_d": opt_d.state_dict(),
                                "step": step, "cfg": cfg}, tmp)
                    os.replace(tmp, tmp[:-4])
                dist.barrier()
            if step >= cfg["max_steps"]:
                break
        epoch += 1

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
