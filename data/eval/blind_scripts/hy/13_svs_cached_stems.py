"""Singing voice separation on the mixed-rate vocal corpus (48 kHz / 44.1 kHz / mp3 sources).

All stems are resampled once to 44.1 kHz float32 wav in --cache; a manifest.json lists the
cached tracks and their lengths. The remix dataset then reads random excerpts from the cache.

    torchrun --nproc_per_node=4 13_svs_cached_stems.py --src /data/vocal_corpus --cache /scratch/svs_cache
"""
import argparse
import json
import os
import random
import time
from pathlib import Path

import librosa
import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SR = 44100
AUDIO_EXT = (".wav", ".flac", ".mp3")


def find_stem(folder, name):
    for ext in AUDIO_EXT:
        p = folder / f"{name}{ext}"
        if p.exists():
            return p
    return None


def prepare_cache(src, cache):
    cache.mkdir(parents=True, exist_ok=True)
    manifest = {}
    for folder in sorted(d for d in src.iterdir() if d.is_dir()):
        voc, acc = find_stem(folder, "vocals"), find_stem(folder, "accompaniment")
        if voc is None or acc is None:
            continue
        out = cache / folder.name
        out.mkdir(exist_ok=True)
        for name, path in (("vocals", voc), ("accompaniment", acc)):
            dst = out / f"{name}.wav"
            if not dst.exists():
                y, _ = librosa.load(str(path), sr=SR, mono=False, res_type="soxr_hq")
                if y.ndim == 1:
                    y = np.stack([y, y])
                sf.write(str(dst), y.T, SR, subtype="FLOAT")
        manifest[folder.name] = min(sf.info(str(out / "vocals.wav")).frames,
                                    sf.info(str(out / "accompaniment.wav")).frames)
    with open(cache / "manifest.json", "w") as f:
        json.dump(manifest, f)
    return manifest


class VoiceRemix(Dataset):
    def __init__(self, cache, names, manifest, seconds, items):
        self.cache, self.names, self.manifest = cache, names, manifest
        self.n = int(seconds * SR)
        self.items = items

    def __len__(self):
        return self.items

    def excerpt(self, name, stem):
        start = random.randint(0, max(0, self.manifest[name] - self.n))
        x, _ = sf.read(str(self.cache / name / f"{stem}.wav"), start=start, frames=self.n, always_2d=True, dtype="float32")
        return np.pad(x, ((0, self.n - len(x)), (0, 0))).T

    def __getitem__(self, i):
        voc = self.excerpt(random.choice(self.names), "vocals") * random.uniform(0.3, 1.2)
        acc = self.excerpt(random.choice(self.names), "accompaniment") * random.uniform(0.3, 1.2)
        if random.random() < 0.05:
            voc = np.zeros_like(voc)
        return torch.from_numpy((voc + acc).astype(np.float32)), torch.from_numpy(voc.astype(np.float32))


class EncBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.GELU(),
                                  nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.GELU())
        self.pool = nn.Conv2d(cout, cout, (2, 2), stride=(2, 2))

    def forward(self, x):
        h = self.conv(x)
        return self.pool(h), h


class DecBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cout, 2, stride=2)
        self.conv = nn.Sequential(nn.Conv2d(2 * cout, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.GELU(),
                                  nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.GELU())

    def forward(self, x, skip):
        return self.conv(torch.cat([self.up(x), skip], 1))


class VocalUNet(nn.Module):
    def __init__(self, n_fft=2048, hop=512, width=32, depth=5):
        super().__init__()
        self.n_fft, self.hop, self.depth = n_fft, hop, depth
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        ch = [4] + [width * 2 ** i for i in range(depth)]
        self.enc = nn.ModuleList(EncBlock(ch[i], ch[i + 1]) for i in range(depth))
        self.mid = nn.Sequential(nn.Conv2d(ch[-1], ch[-1], 3, padding=1), nn.GroupNorm(8, ch[-1]), nn.GELU())
        self.dec = nn.ModuleList(DecBlock(ch[min(i + 2, depth)], ch[i + 1]) for i in reversed(range(depth)))
        self.head = nn.Conv2d(ch[1], 4, 1)

    def forward(self, wav):
        B, C, T = wav.shape
        Z = torch.stft(wav.reshape(B * C, T), self.n_fft, self.hop, window=self.window, return_complex=True)
        Fq, N = Z.shape[-2:]
        Z = Z.reshape(B, C, Fq, N)
        x = torch.view_as_real(Z[:, :, :-1]).permute(0, 1, 4, 2, 3).reshape(B, 2 * C, Fq - 1, N)
        pad = (-N) % (2 ** self.depth)
        x = F.pad(x, (0, pad))
        skips = []
        for e in self.enc:
            x, h = e(x)
            skips.append(h)
        x = self.mid(x)
        for d in self.dec:
            x = d(x, skips.pop())
        m = self.head(x)[..., :N].reshape(B, C, 2, Fq - 1, N).permute(0, 1, 3, 4, 2).contiguous()
        mask = F.pad(torch.view_as_complex(m), (0, 0, 0, 1))
        est = (Z * mask).reshape(B * C, Fq, N)
        return torch.istft(est, self.n_fft, self.hop, window=self.window, length=T).reshape(B, C, T)


@torch.no_grad()
def separate(net, mix, device, chunk=SR * 10, overlap=0.5):
    hop = int(chunk * (1 - overlap))
    T = mix.shape[-1]
    n = max(1, -(-(T - chunk) // hop) + 1)
    x = F.pad(mix, (0, (n - 1) * hop + chunk - T)).to(device)
    w = torch.hann_window(chunk, periodic=False, device=device).clamp_min(1e-3)
    out, norm = torch.zeros_like(x), torch.zeros(x.shape[-1], device=device)
    for i in range(n):
        s = i * hop
        out[:, s:s + chunk] += net(x[None, :, s:s + chunk])[0] * w
        norm[s:s + chunk] += w
    return (out / norm)[:, :T]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", type=Path, required=True)
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("--valid", type=Path, default=Path("lists/svs_valid.txt"))
    ap.add_argument("--out", type=Path, default=Path("exp/svs_unet"))
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--items", type=int, default=16000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    manifest = prepare_cache(args.src, args.cache)
    valid_names = [l.strip() for l in args.valid.read_text().splitlines() if l.strip() in manifest]
    train_names = sorted(set(manifest) - set(valid_names))

    ds = VoiceRemix(args.cache, train_names, manifest, args.seconds, args.items)
    sampler = DistributedSampler(ds, seed=3)
    dl = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=args.workers, pin_memory=True,
                    drop_last=True, worker_init_fn=lambda w: np.random.seed((torch.initial_seed() + rank) % 2 ** 32)
                    or random.seed(torch.initial_seed() + 104729 * rank))

    torch.manual_seed(3)
    net = VocalUNet().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[60, 90], gamma=0.3)

    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
    best = -1e9
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for mix, voc in dl:
            mix, voc = mix.to(device, non_blocking=True), voc.to(device, non_blocking=True)
            est = model(mix)
            loss = F.l1_loss(est, voc) + 0.5 * F.l1_loss(mix - est, mix - voc)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += torch.stack([loss.detach(), torch.ones_like(loss)])
        sched.step()
        dist.all_reduce(loss_sum)

        net.eval()
        sdr_sum = torch.zeros(2, device=device)
        for name in valid_names[rank::world]:
            voc, _ = sf.read(str(args.cache / name / "vocals.wav"), dtype="float32", always_2d=True)
            acc, _ = sf.read(str(args.cache / name / "accompaniment.wav"), dtype="float32", always_2d=True)
            n = manifest[name]
            voc, acc = torch.from_numpy(voc[:n].T), torch.from_numpy(acc[:n].T)
            est = separate(net, voc + acc, device).cpu()
            sdr_sum[0] += 10 * torch.log10(voc.pow(2).sum() / (voc - est).pow(2).sum().clamp_min(1e-9)).item()
            sdr_sum[1] += 1
        dist.all_reduce(sdr_sum)
        net.train()
        sdr = (sdr_sum[0] / sdr_sum[1]).item()

        if rank == 0:
            print(f"epoch {epoch:3d} loss {(loss_sum[0] / loss_sum[1]).item():.4f} vocals SDR {sdr:.2f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch}, args.out / "last.pt")
            if sdr > best:
                best = sdr
                torch.save(net.state_dict(), args.out / "best.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
