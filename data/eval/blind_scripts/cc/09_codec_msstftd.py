"""Neural audio codec (SoundStream / EnCodec style) with residual VQ and a multi-scale STFT discriminator.

torchrun --nnodes=1 --nproc_per_node=8 09_codec_msstftd.py --data_root /data/libritts --exp codec_24k
"""
import argparse
import glob
import math
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import weight_norm
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", required=True)
    p.add_argument("--exp", default="codec")
    p.add_argument("--ckpt_dir", default="checkpoints")
    p.add_argument("--sr", type=int, default=24000)
    p.add_argument("--segment", type=float, default=1.0)
    p.add_argument("--batch_size", type=int, default=12)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--n_q", type=int, default=8)
    p.add_argument("--codebook_size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=400_000)
    p.add_argument("--disc_start", type=int, default=10_000)
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--sample_every", type=int, default=5000)
    p.add_argument("--save_every", type=int, default=10_000)
    return p.parse_args()


class SegmentDataset(Dataset):
    def __init__(self, files, sr, seg_len):
        self.files, self.sr, self.seg_len = files, sr, seg_len

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        wav, sr = torchaudio.load(self.files[i])
        wav = wav.mean(0)
        if sr != self.sr:
            wav = torchaudio.functional.resample(wav, sr, self.sr)
        if wav.numel() > self.seg_len:
            s = random.randint(0, wav.numel() - self.seg_len)
            wav = wav[s:s + self.seg_len]
        else:
            wav = F.pad(wav, (0, self.seg_len - wav.numel()))
        return wav.unsqueeze(0) * random.uniform(0.5, 0.99) / wav.abs().max().clamp(min=1e-4)


def conv_block(cin, cout, stride):
    return nn.Sequential(
        nn.ELU(), weight_norm(nn.Conv1d(cin, cin, 3, padding=1)), nn.ELU(),
        weight_norm(nn.Conv1d(cin, cout, 2 * stride, stride, padding=math.ceil(stride / 2))))


class Encoder(nn.Module):
    def __init__(self, ch=32, dim=128, strides=(2, 4, 5, 8)):
        super().__init__()
        layers = [weight_norm(nn.Conv1d(1, ch, 7, padding=3))]
        for i, s in enumerate(strides):
            layers.append(conv_block(ch * 2 ** i, ch * 2 ** (i + 1), s))
        layers += [nn.ELU(), weight_norm(nn.Conv1d(ch * 2 ** len(strides), dim, 3, padding=1))]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class Decoder(nn.Module):
    def __init__(self, ch=512, dim=128, strides=(8, 5, 4, 2)):
        super().__init__()
        layers = [weight_norm(nn.Conv1d(dim, ch, 7, padding=3))]
        for i, s in enumerate(strides):
            cin, cout = ch // 2 ** i, ch // 2 ** (i + 1)
            layers += [nn.ELU(), weight_norm(nn.ConvTranspose1d(cin, cout, 2 * s, s, padding=s // 2 + s % 2,
                                                                output_padding=s % 2)),
                       nn.ELU(), weight_norm(nn.Conv1d(cout, cout, 3, padding=1))]
        layers += [nn.ELU(), weight_norm(nn.Conv1d(ch // 2 ** len(strides), 1, 7, padding=3)), nn.Tanh()]
        self.net = nn.Sequential(*layers)

    def forward(self, z):
        return self.net(z)


class ResidualVQ(nn.Module):
    def __init__(self, n_q, size, dim):
        super().__init__()
        self.codebooks = nn.ModuleList([nn.Embedding(size, dim) for _ in range(n_q)])
        for cb in self.codebooks:
            nn.init.uniform_(cb.weight, -1.0 / size, 1.0 / size)

    def forward(self, z):
        residual = z.transpose(1, 2)
        quantized = torch.zeros_like(residual)
        commit, cb_loss, codes = 0.0, 0.0, []
        for cb in self.codebooks:
            d = (residual.pow(2).sum(-1, keepdim=True) - 2 * residual @ cb.weight.t() + cb.weight.pow(2).sum(-1))
            idx = d.argmin(-1)
            q = cb(idx)
            commit = commit + F.mse_loss(residual, q.detach())
            cb_loss = cb_loss + F.mse_loss(q, residual.detach())
            quantized = quantized + q
            residual = residual - q.detach()
            codes.append(idx)
        z_q = z.transpose(1, 2) + (quantized - z.transpose(1, 2)).detach()
        return z_q.transpose(1, 2), commit, cb_loss, torch.stack(codes, 1)


class Codec(nn.Module):
    def __init__(self, n_q, codebook_size, dim=128):
        super().__init__()
        self.encoder, self.decoder = Encoder(dim=dim), Decoder(dim=dim)
        self.rvq = ResidualVQ(n_q, codebook_size, dim)

    def forward(self, x):
        z = self.encoder(x)
        z_q, commit, cb_loss, codes = self.rvq(z)
        return self.decoder(z_q)[..., :x.size(-1)], commit, cb_loss, codes


class STFTDisc(nn.Module):
    def __init__(self, n_fft, ch=32):
        super().__init__()
        self.n_fft, self.hop = n_fft, n_fft // 4
        self.register_buffer("window", torch.hann_window(n_fft))
        self.convs = nn.ModuleList([
            weight_norm(nn.Conv2d(2, ch, (3, 9), padding=(1, 4))),
            weight_norm(nn.Conv2d(ch, ch, (3, 9), (1, 2), padding=(1, 4))),
            weight_norm(nn.Conv2d(ch, ch, (3, 9), (1, 2), padding=(2, 4), dilation=(2, 1))),
            weight_norm(nn.Conv2d(ch, ch, (3, 9), (1, 2), padding=(4, 4), dilation=(4, 1))),
            weight_norm(nn.Conv2d(ch, ch, (3, 3), padding=(1, 1))),
        ])
        self.post = weight_norm(nn.Conv2d(ch, 1, (3, 3), padding=(1, 1)))

    def forward(self, x):
        spec = torch.stft(x.squeeze(1), self.n_fft, self.hop, window=self.window, return_complex=True)
        h = torch.stack([spec.real, spec.imag], 1).transpose(2, 3)
        fmap = []
        for c in self.convs:
            h = F.leaky_relu(c(h), 0.2)
            fmap.append(h)
        return self.post(h), fmap


class MultiScaleSTFTDisc(nn.Module):
    def __init__(self, ffts=(2048, 1024, 512, 256, 128)):
        super().__init__()
        self.discs = nn.ModuleList([STFTDisc(n) for n in ffts])

    def forward(self, x):
        return [d(x) for d in self.discs]


class MultiScaleMelLoss(nn.Module):
    def __init__(self, sr):
        super().__init__()
        self.mels = nn.ModuleList([torchaudio.transforms.MelSpectrogram(sr, n_fft=2 ** i, hop_length=2 ** i // 4,
                                                                        n_mels=64, power=1.0) for i in range(6, 12)])

    def forward(self, y_hat, y):
        loss = 0.0
        for m in self.mels:
            a, b = m(y_hat), m(y)
            loss = loss + F.l1_loss(a, b) + F.mse_loss(torch.log(a + 1e-5), torch.log(b + 1e-5)) ** 0.5
        return loss / len(self.mels)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    wandb.init(project="neural-codec", name=args.exp, config=vars(args))

    files = sorted(glob.glob(os.path.join(args.data_root, "**", "*.wav"), recursive=True))
    ds = SegmentDataset(files, args.sr, int(args.segment * args.sr))
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                    drop_last=True, persistent_workers=True)

    codec = Codec(args.n_q, args.codebook_size).to(device)
    disc = MultiScaleSTFTDisc().to(device)
    mel_loss = MultiScaleMelLoss(args.sr).to(device)
    opt_g = torch.optim.Adam(codec.parameters(), lr=args.lr, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(disc.parameters(), lr=args.lr, betas=(0.5, 0.9))

    ckpt_dir = os.path.join(args.ckpt_dir, args.exp)
    ckpt_path = os.path.join(ckpt_dir, "last.pt")
    step, epoch = 0, 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        codec.load_state_dict(ck["codec"]); disc.load_state_dict(ck["disc"])
        opt_g.load_state_dict(ck["opt_g"]); opt_d.load_state_dict(ck["opt_d"])
        step, epoch = ck["step"], ck["epoch"]
    codec = DDP(codec, device_ids=[local_rank])
    disc = DDP(disc, device_ids=[local_rank])

    while step < args.steps:
        sampler.set_epoch(epoch)
        for x in dl:
            x = x.to(device, non_blocking=True)
            y_hat, commit, cb_loss, _ = codec(x)
            train_disc = step >= args.disc_start

            if train_disc:
                d_real = disc(x)
                d_fake = disc(y_hat.detach())
                loss_d = sum(F.relu(1 - r[0]).mean() + F.relu(1 + f[0]).mean() for r, f in zip(d_real, d_fake))
                loss_d = loss_d / len(d_real)
                opt_d.zero_grad(set_to_none=True)
                loss_d.backward()
                opt_d.step()

            l_mel = mel_loss(y_hat.squeeze(1), x.squeeze(1))
            l_wav = F.l1_loss(y_hat, x)
            loss_g = 45.0 * l_mel + l_wav + 1.0 * commit + 1.0 * cb_loss
            l_adv = l_fm = torch.zeros((), device=device)
            if train_disc:
                d_fake = disc(y_hat)
                with torch.no_grad():
                    d_real = disc(x)
                l_adv = sum(F.relu(1 - f[0]).mean() for f in d_fake) / len(d_fake)
                l_fm = sum(F.l1_loss(fg, fr) / (fr.abs().mean() + 1e-8)
                           for (_, fm_r), (_, fm_g) in zip(d_real, d_fake) for fr, fg in zip(fm_r, fm_g))
                l_fm = l_fm / (len(d_fake) * len(d_fake[0][1]))
                loss_g = loss_g + 3.0 * l_adv + 3.0 * l_fm
            opt_g.zero_grad(set_to_none=True)
            loss_g.backward()
            torch.nn.utils.clip_grad_norm_(codec.parameters(), 100.0)
            opt_g.step()
            step += 1

            if step % args.log_every == 0:
                wandb.log({"loss/g": loss_g.item(), "loss/mel": l_mel.item(), "loss/wav": l_wav.item(),
                           "loss/commit": float(commit), "loss/adv": l_adv.item(), "loss/fm": l_fm.item(),
                           "epoch": epoch}, step=step)

            if rank == 0 and step % args.sample_every == 0:
                with torch.no_grad():
                    rec, _, _, codes = codec.module(x[:2])
                wandb.log({f"audio/orig_{i}": wandb.Audio(x[i, 0].cpu().numpy(), sample_rate=args.sr)
                           for i in range(2)} |
                          {f"audio/rec_{i}": wandb.Audio(rec[i, 0].float().cpu().numpy(), sample_rate=args.sr)
                           for i in range(2)} |
                          {"codes/unique_q0": codes[:, 0].unique().numel()}, step=step)

            if rank == 0 and step % args.save_every == 0:
                os.makedirs(ckpt_dir, exist_ok=True)
                state = {"codec": codec.module.state_dict(), "disc": disc.module.state_dict(),
                         "opt_g": opt_g.state_dict(), "opt_d": opt_d.state_dict(), "step": step, "epoch": epoch}
                torch.save(state, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
            if step >= args.steps:
                break
        epoch += 1

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
