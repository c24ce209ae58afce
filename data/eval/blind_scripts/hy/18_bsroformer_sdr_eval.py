"""Band-split Transformer (BS-RoFormer style, without rotary embeddings) for one target stem.

Validation runs on full songs: each song is separated in overlapping chunks and scored with
the utterance-level SDR ("cSDR") used in the MDX challenges.

    torchrun --nproc_per_node=8 18_bsroformer_sdr_eval.py --root /data/musdb18hq --target vocals --out exp/bsrof_voc
"""
import argparse
import logging
import os
import random
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

STEMS = ["vocals", "drums", "bass", "other"]
log = logging.getLogger("bsrof")


def bands_for(n_fft):
    n_bins = n_fft // 2 + 1
    widths = [2] * 24 + [4] * 12 + [12] * 8 + [24] * 8 + [48] * 8 + [128, 129]
    edges, acc = [0], 0
    for w in widths:
        acc = min(n_bins, acc + w)
        if acc > edges[-1]:
            edges.append(acc)
    if edges[-1] < n_bins:
        edges.append(n_bins)
    return list(zip(edges[:-1], edges[1:]))


class AxisTransformer(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.time = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, batch_first=True, norm_first=True)
        self.band = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, batch_first=True, norm_first=True)

    def forward(self, z):  # B K T D
        B, K, T, D = z.shape
        z = self.time(z.reshape(B * K, T, D)).reshape(B, K, T, D)
        z = self.band(z.transpose(1, 2).reshape(B * T, K, D)).reshape(B, T, K, D).transpose(1, 2)
        return z


class BSTransformer(nn.Module):
    def __init__(self, n_fft=2048, hop=512, d=192, heads=8, depth=8, ch=2):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.bands = bands_for(n_fft)
        self.split = nn.ModuleList(nn.Sequential(nn.RMSNorm(2 * ch * (b - a)), nn.Linear(2 * ch * (b - a), d))
                                   for a, b in self.bands)
        self.layers = nn.ModuleList(AxisTransformer(d, heads) for _ in range(depth))
        self.norm = nn.RMSNorm(d)
        self.masks = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.Tanh(), nn.Linear(4 * d, 2 * 2 * ch * (b - a)),
                                                 nn.GLU(-1)) for a, b in self.bands)
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)

    def forward(self, wav):
        B, C, N = wav.shape
        Z = torch.stft(wav.reshape(B * C, N), self.n_fft, self.hop, window=self.window, return_complex=True)
        Z = Z.reshape(B, C, *Z.shape[-2:])
        X = torch.view_as_real(Z).permute(0, 3, 1, 2, 4)  # B T C F 2
        T = X.shape[1]
        z = torch.stack([p(X[:, :, :, a:b].reshape(B, T, -1)) for (a, b), p in zip(self.bands, self.split)], 1)
        for layer in self.layers:
            z = layer(z)
        z = self.norm(z)
        m = torch.cat([mlp(z[:, k]).reshape(B, T, C, b - a, 2) for k, ((a, b), mlp) in enumerate(zip(self.bands, self.masks))], 3)
        mask = torch.view_as_complex(m.permute(0, 2, 3, 1, 4).contiguous())
        Y = (Z * mask).reshape(B * C, *Z.shape[-2:])
        return torch.istft(Y, self.n_fft, self.hop, window=self.window, length=N).reshape(B, C, N)


class TrainRemix(Dataset):
    def __init__(self, tracks, target, seconds, items, sr=44100):
        self.tracks, self.target, self.items = tracks, target, items
        self.n = int(seconds * sr)
        self.frames = [sf.info(str(t / "mixture.wav")).frames for t in tracks]

    def __len__(self):
        return self.items

    def __getitem__(self, i):
        out = {}
        for stem in STEMS:
            k = random.randrange(len(self.tracks))
            off = random.randint(0, max(0, self.frames[k] - self.n))
            x, _ = sf.read(str(self.tracks[k] / f"{stem}.wav"), start=off, frames=self.n, dtype="float32", always_2d=True)
            out[stem] = np.pad(x, ((0, self.n - len(x)), (0, 0))).T * random.uniform(0.5, 1.25)
        mix = sum(out.values())
        return torch.from_numpy(mix.astype(np.float32)), torch.from_numpy(out[self.target].astype(np.float32))


class FullTracks(Dataset):
    def __init__(self, tracks, target):
        self.tracks, self.target = tracks, target

    def __len__(self):
        return len(self.tracks)

    def __getitem__(self, i):
        mix, _ = sf.read(str(self.tracks[i] / "mixture.wav"), dtype="float32", always_2d=True)
        ref, _ = sf.read(str(self.tracks[i] / f"{self.target}.wav"), dtype="float32", always_2d=True)
        return torch.from_numpy(mix.T.copy()), torch.from_numpy(ref.T.copy())


@torch.no_grad()
def chunked(net, mix, device, chunk=44100 * 8, step=44100 * 4, batch=6):
    T = mix.shape[-1]
    n = max(1, -(-(T - chunk) // step) + 1)
    L = (n - 1) * step + chunk
    x = F.pad(mix, (0, L - T))
    fade = torch.hann_window(chunk, periodic=False, device=device).clamp_min(1e-2)
    out = torch.zeros(x.shape[0], L, device=device)
    w = torch.zeros(L, device=device)
    for i in range(0, n, batch):
        idx = list(range(i, min(n, i + batch)))
        y = net(torch.stack([x[:, j * step:j * step + chunk] for j in idx]).to(device))
        for j, yy in zip(idx, y):
            out[:, j * step:j * step + chunk] += yy * fade
            w[j * step:j * step + chunk] += fade
    return (out / w)[:, :T]


def csdr(ref, est, eps=1e-7):
    return 10 * torch.log10((ref.pow(2).sum() + eps) / ((ref - est).pow(2).sum() + eps))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--target", default="vocals", choices=STEMS)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--items", type=int, default=24000)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--n-valid", type=int, default=14)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    tracks = sorted(p for p in (args.root / "train").iterdir() if p.is_dir())
    valid_tracks, train_tracks = tracks[-args.n_valid:], tracks[:-args.n_valid]

    train_ds = TrainRemix(train_tracks, args.target, args.seconds, args.items)
    train_sampler = DistributedSampler(train_ds)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=8, pin_memory=True,
                          drop_last=True, worker_init_fn=lambda w: random.seed(torch.initial_seed() + 65537 * rank))
    valid_ds = FullTracks(valid_tracks, args.target)
    valid_dl = DataLoader(valid_ds, batch_size=1, sampler=DistributedSampler(valid_ds, shuffle=False), num_workers=2)

    torch.manual_seed(42)
    net = BSTransformer().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = 2000
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))

    best = -float("inf")
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, (mix, ref) in enumerate(train_dl):
            mix, ref = mix.to(device, non_blocking=True), ref.to(device, non_blocking=True)
            est = model(mix)
            loss = F.l1_loss(est, ref)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            sched.step()
            if it % 200 == 0:
                log.info("epoch %d it %d loss %.4f", epoch, it, loss.item())

        net.eval()
        scores = []
        for mix, ref in valid_dl:
            est = chunked(net, mix[0], device)
            scores.append(csdr(ref[0].to(device), est).item())
        net.train()
        valid_sdr = float(np.mean(scores))
        log.info("epoch %d valid %s cSDR %.3f dB", epoch, args.target, valid_sdr)

        if rank == 0:
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, args.out / "last.ckpt")
            if valid_sdr > best:
                best = valid_sdr
                torch.save(net.state_dict(), args.out / f"best_{args.target}.ckpt")
                log.info("new best %.3f", best)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
