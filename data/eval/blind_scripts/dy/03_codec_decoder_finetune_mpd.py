"""Fine-tune the decoder of our 24 kHz codec on a new domain (podcast speech).

Encoder and RVQ stay frozen so the token vocabulary the LMs were trained on does not
move; only the decoder is trained, against a HiFi-GAN multi-period discriminator and
a multi-resolution STFT loss.
"""
import argparse
import glob
import logging
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import spectral_norm, weight_norm
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from codec.model import load_codec  # in-house package, returns encoder/quantizer/decoder

logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
log = logging.getLogger("dec-ft")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--codec-ckpt", required=True)
    ap.add_argument("--data-glob", default="/data/podcasts/wav24k/**/*.wav")
    ap.add_argument("--ckpt-dir", default="/checkpoints/dec_ft_podcast")
    ap.add_argument("--segment", type=int, default=24000 * 2)
    ap.add_argument("--batch-size", type=int, default=16, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=300_000)
    ap.add_argument("--save-interval", type=int, default=10_000)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--log-interval", type=int, default=100)
    ap.add_argument("--audio-interval", type=int, default=5000)
    return ap.parse_args()


class SegmentDataset(Dataset):
    def __init__(self, files, segment):
        self.files, self.segment = files, segment

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        wav, _ = torchaudio.load(self.files[idx])
        wav = wav[:1]
        if wav.shape[1] >= self.segment:
            start = random.randint(0, wav.shape[1] - self.segment)
            wav = wav[:, start : start + self.segment]
        else:
            wav = F.pad(wav, (0, self.segment - wav.shape[1]))
        return wav


class PeriodDisc(nn.Module):
    def __init__(self, period, use_sn=False):
        super().__init__()
        norm = spectral_norm if use_sn else weight_norm
        self.period = period
        chs = [1, 32, 128, 512, 1024, 1024]
        self.convs = nn.ModuleList(
            norm(nn.Conv2d(chs[i], chs[i + 1], (5, 1), (3 if i < 4 else 1, 1), padding=(2, 0)))
            for i in range(5)
        )
        self.post = norm(nn.Conv2d(1024, 1, (3, 1), padding=(1, 0)))

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


class MultiPeriodDisc(nn.Module):
    def __init__(self, periods=(2, 3, 5, 7, 11)):
        super().__init__()
        self.discs = nn.ModuleList(PeriodDisc(p) for p in periods)

    def forward(self, y, y_hat):
        real, fake, fmap_r, fmap_f = [], [], [], []
        for d in self.discs:
            r, fr = d(y)
            g, fg = d(y_hat)
            real.append(r), fake.append(g), fmap_r.append(fr), fmap_f.append(fg)
        return real, fake, fmap_r, fmap_f


def stft_mag(x, n_fft, hop, win):
    spec = torch.stft(x.squeeze(1), n_fft, hop, win, window=torch.hann_window(win, device=x.device),
                      return_complex=True)
    return spec.abs().clamp(min=1e-7)


def mr_stft_loss(y_hat, y, resolutions=((512, 128, 512), (1024, 256, 1024), (2048, 512, 2048))):
    loss = 0.0
    for n_fft, hop, win in resolutions:
        m_hat, m = stft_mag(y_hat, n_fft, hop, win), stft_mag(y, n_fft, hop, win)
        sc = torch.norm(m - m_hat, p="fro") / torch.norm(m, p="fro")
        mag = F.l1_loss(torch.log(m_hat), torch.log(m))
        loss = loss + sc + mag
    return loss / len(resolutions)


def feature_loss(fmap_r, fmap_g):
    return sum(F.l1_loss(g, r.detach()) for dr, dg in zip(fmap_r, fmap_g) for r, g in zip(dr, dg))


def d_loss_fn(real, fake):
    return sum(torch.mean((1 - r) ** 2) + torch.mean(g ** 2) for r, g in zip(real, fake))


def g_adv_fn(fake):
    return sum(torch.mean((1 - g) ** 2) for g in fake)


class CodecDecoderFT(nn.Module):
    """Frozen encoder + RVQ, trainable decoder."""

    def __init__(self, codec):
        super().__init__()
        self.encoder, self.quantizer, self.decoder = codec.encoder, codec.quantizer, codec.decoder
        self.encoder.requires_grad_(False)
        self.quantizer.requires_grad_(False)

    def forward(self, wav):
        with torch.no_grad():
            self.encoder.eval()
            self.quantizer.eval()
            zq = self.quantizer(self.encoder(wav))[0]
        return self.decoder(zq)[..., : wav.shape[-1]]


def save_checkpoint(ckpt_dir, step, gen, disc, opt_g, opt_d, keep):
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, f"step_{step:07d}.pt")
    torch.save({
        "decoder": gen.module.decoder.state_dict(),
        "disc": disc.module.state_dict(),
        "opt_g": opt_g.state_dict(),
        "opt_d": opt_d.state_dict(),
        "step": step,
    }, path)
    old = sorted(glob.glob(os.path.join(ckpt_dir, "step_*.pt")))[:-keep]
    for f in old:
        os.remove(f)
    log.info("saved %s", path)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1000 + rank)
    random.seed(1000 + rank)

    files = sorted(glob.glob(args.data_glob, recursive=True))
    dataset = SegmentDataset(files, args.segment)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    codec = load_codec(args.codec_ckpt, map_location="cpu")
    gen = CodecDecoderFT(codec).to(device)
    disc = MultiPeriodDisc().to(device)
    gen = DDP(gen, device_ids=[local_rank])
    disc = DDP(disc, device_ids=[local_rank])

    opt_g = torch.optim.AdamW(gen.module.decoder.parameters(), lr=args.lr, betas=(0.8, 0.99))
    opt_d = torch.optim.AdamW(disc.parameters(), lr=args.lr, betas=(0.8, 0.99))

    step = 0
    existing = sorted(glob.glob(os.path.join(args.ckpt_dir, "step_*.pt")))
    if existing:
        state = torch.load(existing[-1], map_location="cpu")
        gen.module.decoder.load_state_dict(state["decoder"])
        disc.module.load_state_dict(state["disc"])
        opt_g.load_state_dict(state["opt_g"])
        opt_d.load_state_dict(state["opt_d"])
        step = state["step"]
        log.info("rank %d resumed at step %d", rank, step)

    writer = SummaryWriter(os.path.join(args.ckpt_dir, "tb")) if rank == 0 else None
    fixed = torch.stack([dataset[i] for i in range(4)]).to(device) if rank == 0 else None

    epoch = step // len(loader)
    while step < args.steps:
        sampler.set_epoch(epoch)
        for y in loader:
            y = y.to(device, non_blocking=True)
            y_hat = gen(y)

            real, fake, _, _ = disc(y, y_hat.detach())
            loss_d = d_loss_fn(real, fake)
            opt_d.zero_grad(set_to_none=True)
            loss_d.backward()
            opt_d.step()

            _, fake, fmap_r, fmap_g = disc(y, y_hat)
            loss_stft = mr_stft_loss(y_hat, y)
            loss_adv = g_adv_fn(fake)
            loss_fm = feature_loss(fmap_r, fmap_g)
            loss_g = 45.0 * loss_stft + loss_adv + 2.0 * loss_fm
            opt_g.zero_grad(set_to_none=True)
            loss_g.backward()
            opt_g.step()
            step += 1

            if step % args.log_interval == 0:
                vals = torch.stack([loss_d.detach(), loss_stft.detach(), loss_adv.detach(), loss_fm.detach()])
                dist.all_reduce(vals)
                vals /= dist.get_world_size()
                if rank == 0:
                    for name, v in zip(("d", "stft", "adv", "fm"), vals.tolist()):
                        writer.add_scalar(f"loss/{name}", v, step)
                    log.info("step %d d=%.3f stft=%.3f adv=%.3f fm=%.3f", step, *vals.tolist())

            if rank == 0 and step % args.audio_interval == 0:
                with torch.no_grad():
                    rec = gen.module(fixed)
                for i in range(rec.shape[0]):
                    writer.add_audio(f"rec/{i}", rec[i].float().cpu(), step, sample_rate=24000)

            if step % args.save_interval == 0:
                save_checkpoint(args.ckpt_dir, step, gen, disc, opt_g, opt_d, args.keep)

            if step >= args.steps:
                break
        epoch += 1

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
