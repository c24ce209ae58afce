"""DCCRN-CL speech enhancement on DNS-Challenge data, dynamic noise mixing, multi-GPU.

    torchrun --standalone --nproc_per_node=8 02_dccrn_dns_enhance.py \
        --clean_dir /data/dns/clean --noise_dir /data/dns/noise --test_dir /data/dns/test_set/synthetic/no_reverb
"""
import argparse
import glob
import logging
import math
import os

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pesq import pesq
from pystoi import stoi
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

SR = 16000
N_FFT, HOP, WIN = 512, 100, 400
log = logging.getLogger(__name__)


class DynamicMixDataset(Dataset):
    """Each item: a random 4 s crop of one clean utterance + a random noise at a random SNR."""

    def __init__(self, clean_dir, noise_dir, segment=4.0, snr_range=(-5, 20)):
        self.clean = sorted(glob.glob(os.path.join(clean_dir, "**", "*.wav"), recursive=True))
        self.noise = sorted(glob.glob(os.path.join(noise_dir, "**", "*.wav"), recursive=True))
        self.seg = int(segment * SR)
        self.snr_range = snr_range

    def __len__(self):
        return len(self.clean)

    def _crop(self, path, rng):
        n = sf.info(path).frames
        if n <= self.seg:
            x, _ = sf.read(path, dtype="float32")
            return np.pad(x, (0, self.seg - n))
        start = rng.integers(0, n - self.seg)
        return sf.read(path, start=start, stop=start + self.seg, dtype="float32")[0]

    def __getitem__(self, idx):
        rng = np.random.default_rng()
        clean = self._crop(self.clean[idx], rng)
        noise = self._crop(self.noise[rng.integers(len(self.noise))], rng)
        snr = rng.uniform(*self.snr_range)
        p_c = np.mean(clean ** 2) + 1e-8
        p_n = np.mean(noise ** 2) + 1e-8
        noise = noise * np.sqrt(p_c / (p_n * 10 ** (snr / 10)))
        noisy = clean + noise
        scale = 0.9 / max(np.abs(noisy).max(), 1e-4)
        if scale < 1.0:
            noisy, clean = noisy * scale, clean * scale
        return torch.from_numpy(noisy.astype(np.float32)), torch.from_numpy(clean.astype(np.float32))


class ComplexConv2d(nn.Module):
    def __init__(self, cin, cout, transpose=False):
        super().__init__()
        if transpose:
            mk = lambda: nn.ConvTranspose2d(cin, cout, (5, 2), (2, 1), (2, 0), output_padding=(1, 0))
        else:
            mk = lambda: nn.Conv2d(cin, cout, (5, 2), (2, 1), (2, 0))
        self.re, self.im = mk(), mk()
        self.transpose = transpose

    def forward(self, x):
        if not self.transpose:
            x = F.pad(x, (1, 0))  # causal in time
        xr, xi = x.chunk(2, dim=1)
        out = torch.cat([self.re(xr) - self.im(xi), self.re(xi) + self.im(xr)], dim=1)
        return out[..., :-1] if self.transpose else out


class DCCRN(nn.Module):
    def __init__(self, channels=(16, 32, 64, 128, 256, 256), rnn_hidden=256):
        super().__init__()
        chans = (1,) + tuple(channels)
        self.enc = nn.ModuleList()
        self.dec = nn.ModuleList()
        for i in range(len(channels)):
            self.enc.append(nn.Sequential(ComplexConv2d(chans[i], chans[i + 1]),
                                          nn.BatchNorm2d(2 * chans[i + 1]), nn.PReLU()))
        for i in reversed(range(len(channels))):
            layers = [ComplexConv2d(2 * chans[i + 1], chans[i] if i > 0 else 1, transpose=True)]
            if i > 0:
                layers += [nn.BatchNorm2d(2 * chans[i]), nn.PReLU()]
            self.dec.append(nn.Sequential(*layers))
        feat = 2 * channels[-1] * 4
        self.lstm = nn.LSTM(feat, rnn_hidden, num_layers=2, batch_first=True)
        self.proj = nn.Linear(rnn_hidden, feat)
        self.register_buffer("window", torch.hann_window(WIN), persistent=False)

    def stft(self, wav):
        spec = torch.stft(wav, N_FFT, HOP, WIN, self.window, return_complex=True)
        return spec[:, 1:]  # drop DC -> 256 bins

    def forward(self, wav):
        spec = self.stft(wav)
        x = torch.stack([spec.real, spec.imag], dim=1)  # B, 2, F, T
        skips = []
        for layer in self.enc:
            x = layer(x)
            skips.append(x)
        B, C, Fq, T = x.shape
        h, _ = self.lstm(x.permute(0, 3, 1, 2).reshape(B, T, C * Fq))
        x = self.proj(h).reshape(B, T, C, Fq).permute(0, 2, 3, 1)
        for layer in self.dec:
            s = skips.pop()
            xr, xi = x.chunk(2, 1)
            sr, si = s.chunk(2, 1)
            x = layer(torch.cat([xr, sr, xi, si], dim=1))
        mr, mi = x[:, 0], x[:, 1]
        mag = torch.tanh(torch.sqrt(mr ** 2 + mi ** 2 + 1e-8))
        phase = torch.atan2(mi, mr)
        est = spec * torch.polar(mag, phase)
        est = F.pad(est, (0, 0, 1, 0))
        return torch.istft(est, N_FFT, HOP, WIN, self.window, length=wav.shape[-1])


def neg_si_snr(est, ref, eps=1e-8):
    est = est - est.mean(-1, keepdim=True)
    ref = ref - ref.mean(-1, keepdim=True)
    t = (est * ref).sum(-1, keepdim=True) / (ref.pow(2).sum(-1, keepdim=True) + eps) * ref
    return -(10 * torch.log10(t.pow(2).sum(-1) / ((est - t).pow(2).sum(-1) + eps) + eps)).mean()


@torch.no_grad()
def evaluate(net, test_dir, rank, world_size, device):
    noisy_files = sorted(glob.glob(os.path.join(test_dir, "noisy", "*.wav")))
    pesq_sum = stoi_sum = sisnr_sum = 0.0
    n = 0
    for path in noisy_files[rank::world_size]:
        fileid = path.rsplit("_fileid_", 1)[-1]
        noisy, _ = sf.read(path, dtype="float32")
        clean, _ = sf.read(os.path.join(test_dir, "clean", f"clean_fileid_{fileid}"), dtype="float32")
        est = net(torch.from_numpy(noisy)[None].to(device))[0]
        sisnr_sum += -neg_si_snr(est, torch.from_numpy(clean).to(device)).item()
        est = est.cpu().numpy()
        pesq_sum += pesq(SR, clean, est, "wb")
        stoi_sum += stoi(clean, est, SR, extended=False)
        n += 1
    totals = torch.tensor([pesq_sum, stoi_sum, sisnr_sum, n], dtype=torch.float64)
    dist.all_reduce(totals)
    return {"pesq": (totals[0] / totals[3]).item(), "stoi": (totals[1] / totals[3]).item(),
            "si_snr": (totals[2] / totals[3]).item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clean_dir", required=True)
    ap.add_argument("--noise_dir", required=True)
    ap.add_argument("--test_dir", required=True)
    ap.add_argument("--out", default="runs/dccrn_dns")
    ap.add_argument("--global_batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed + rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR)

    assert args.global_batch % world_size == 0
    per_gpu = args.global_batch // world_size
    train_set = DynamicMixDataset(args.clean_dir, args.noise_dir)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=per_gpu, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = DCCRN()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    steps_per_epoch = len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 2000) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / (args.epochs * steps_per_epoch)))))

    writer = SummaryWriter(args.out) if rank == 0 else None
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for noisy, clean in loader:
            noisy, clean = noisy.to(device, non_blocking=True), clean.to(device, non_blocking=True)
            loss = neg_si_snr(model(noisy), clean)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            step += 1
            if step % 100 == 0:
                avg = loss.detach().clone()
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                if writer:
                    writer.add_scalar("train/neg_si_snr", avg.item(), step)
                    writer.add_scalar("train/lr", sched.get_last_lr()[0], step)

        model.eval()
        scores = evaluate(model.module, args.test_dir, rank, world_size, device)
        if rank == 0:
            log.info("epoch %d  PESQ %.3f  STOI %.4f  SI-SNR %.2f", epoch, scores["pesq"], scores["stoi"], scores["si_snr"])
            for k, v in scores.items():
                writer.add_scalar(f"test/{k}", v, epoch)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict()},
                       os.path.join(args.out, f"epoch{epoch:03d}.pt"))
        dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
