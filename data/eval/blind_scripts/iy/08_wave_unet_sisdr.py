"""Wave-U-Net speech denoiser trained end-to-end on the waveform with a negative
SI-SDR loss. Noisy inputs are synthesised on the fly from clean speech and a
noise corpus at random SNRs.

    torchrun --nproc_per_node=8 08_wave_unet_sisdr.py --clean /data/clean_fullband_16k \
        --noise /data/noise_fullband_16k --valid /data/dns_blind_synthetic --batch-size 128
"""
import argparse
import logging
import math
import os
import random
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pesq import pesq
from pystoi import stoi
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)


class NoiseMixer(Dataset):
    def __init__(self, clean_dir, noise_dir, seg_samples=16384 * 2, snr_db=(-5.0, 25.0)):
        self.clean = sorted(str(p) for p in Path(clean_dir).rglob("*.wav"))
        self.noise = sorted(str(p) for p in Path(noise_dir).rglob("*.wav"))
        self.seg = seg_samples
        self.snr_db = snr_db

    def __len__(self):
        return len(self.clean)

    def _take(self, path):
        frames = sf.info(path).frames
        if frames <= self.seg:
            x, _ = sf.read(path, dtype="float32", always_2d=True)
            return np.resize(x[:, 0], self.seg)
        st = random.randrange(frames - self.seg)
        x, _ = sf.read(path, start=st, frames=self.seg, dtype="float32", always_2d=True)
        return x[:, 0]

    def __getitem__(self, i):
        s = self._take(self.clean[i])
        n = self._take(random.choice(self.noise))
        snr = random.uniform(*self.snr_db)
        ps, pn = np.mean(s ** 2), np.mean(n ** 2) + 1e-10
        n = n * np.sqrt(ps / (pn * 10 ** (snr / 10)))
        x = s + n
        m = np.abs(x).max()
        if m > 1.0:
            x, s = x / m, s / m
        return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(s.astype(np.float32))


class Down(nn.Module):
    def __init__(self, cin, cout, k=15):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, k, padding=k // 2)

    def forward(self, x):
        h = F.leaky_relu(self.conv(x), 0.2)
        return h[..., ::2], h


class Up(nn.Module):
    def __init__(self, cin, cskip, cout, k=5):
        super().__init__()
        self.conv = nn.Conv1d(cin + cskip, cout, k, padding=k // 2)

    def forward(self, x, skip):
        x = F.interpolate(x, size=skip.shape[-1], mode="linear", align_corners=True)
        return F.leaky_relu(self.conv(torch.cat([x, skip], 1)), 0.2)


class WaveUNet(nn.Module):
    def __init__(self, layers=10, base=24):
        super().__init__()
        ch = [1] + [base * (i + 1) for i in range(layers)]
        self.downs = nn.ModuleList([Down(ch[i], ch[i + 1]) for i in range(layers)])
        self.mid = nn.Conv1d(ch[-1], ch[-1] + base, 15, padding=7)
        ups, cin = [], ch[-1] + base
        for i in range(layers, 0, -1):
            ups.append(Up(cin, ch[i], ch[i]))
            cin = ch[i]
        self.ups = nn.ModuleList(ups)
        self.out = nn.Conv1d(cin + 1, 1, 1)
        self.multiple = 2 ** layers

    def forward(self, wav):
        T = wav.shape[-1]
        x = F.pad(wav, (0, (-T) % self.multiple)).unsqueeze(1)
        inp = x
        skips = []
        for d in self.downs:
            x, s = d(x)
            skips.append(s)
        x = F.leaky_relu(self.mid(x), 0.2)
        for u in self.ups:
            x = u(x, skips.pop())
        return torch.tanh(self.out(torch.cat([x, inp], 1))).squeeze(1)[..., :T]


def neg_si_sdr(est, ref, eps=1e-8):
    ref = ref - ref.mean(-1, keepdim=True)
    est = est - est.mean(-1, keepdim=True)
    alpha = (est * ref).sum(-1, keepdim=True) / (ref.pow(2).sum(-1, keepdim=True) + eps)
    target = alpha * ref
    return -10 * torch.log10(target.pow(2).sum(-1) / ((est - target).pow(2).sum(-1) + eps) + eps)


@torch.no_grad()
def enhance_full(net, wav, seg=16384 * 4, ctx=4096):
    """Run the net on a long utterance in segments with `ctx` samples of context on each side."""
    T = wav.shape[-1]
    padded = F.pad(wav, (ctx, ctx + seg))
    out = []
    for st in range(0, T, seg):
        window = padded[st:st + seg + 2 * ctx]
        out.append(net(window[None])[0, ctx:ctx + seg])
    return torch.cat(out)[:T]


@torch.no_grad()
def evaluate(net, valid_dir, rank, world, device, sr=16000):
    net.eval()
    noisy_files = sorted((Path(valid_dir) / "noisy").glob("*.wav"))[rank::world]
    sums = torch.zeros(4, device=device)
    for nf in noisy_files:
        noisy, _ = sf.read(str(nf), dtype="float32")
        clean, _ = sf.read(str(Path(valid_dir) / "clean" / nf.name), dtype="float32")
        est = enhance_full(net, torch.from_numpy(noisy).to(device))
        sums[0] += -neg_si_sdr(est, torch.from_numpy(clean).to(device))
        e = est.cpu().numpy()
        sums[1] += pesq(sr, clean, e, "wb")
        sums[2] += stoi(clean, e, sr, extended=True)
        sums[3] += 1
    dist.all_reduce(sums)
    net.train()
    return {"si_sdr": (sums[0] / sums[3]).item(), "pesq": (sums[1] / sums[3]).item(),
            "estoi": (sums[2] / sums[3]).item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clean", required=True)
    ap.add_argument("--noise", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--out", default="exp/waveunet")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=128, help="global batch size over all GPUs")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    torch.manual_seed(7)
    random.seed(7 + rank)

    per_gpu = args.batch_size // world
    ds = NoiseMixer(args.clean, args.noise)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=per_gpu, sampler=sampler, num_workers=args.workers,
                    pin_memory=True, drop_last=True)

    net = WaveUNet().to(device)
    model = DDP(net, device_ids=[local_rank], gradient_as_bucket_view=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    os.makedirs(args.out, exist_ok=True)
    log.info("%d training clips, %d per GPU per step, %d steps/epoch", len(ds), per_gpu, len(dl))

    best = -math.inf
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        running, n = 0.0, 0
        for noisy, clean in dl:
            noisy, clean = noisy.to(device, non_blocking=True), clean.to(device, non_blocking=True)
            # SI-SDR is undefined on an all-silent reference
            if (clean.pow(2).mean(-1) < 1e-8).any():
                continue
            loss = neg_si_sdr(model(noisy), clean).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            running += loss.item()
            n += 1
        log.info("epoch %d: train -SI-SDR %.3f", epoch, running / max(n, 1))

        metrics = evaluate(net, args.valid, rank, world, device)
        log.info("epoch %d: valid %s", epoch, metrics)
        if rank == 0:
            torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
            if metrics["si_sdr"] > best:
                best = metrics["si_sdr"]
                torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
