"""Dual-path RNN (time domain) vocal / accompaniment separation with GPU-side remixing.

The loader returns the four aligned MUSDB stems of an excerpt; on the GPU the stems are
shuffled across the batch (each stem of each item may come from another excerpt) and
re-gained, then vocals vs. the rest form the training pair.

    torchrun --nproc_per_node=4 16_dprnn_vocals_gpu_remix.py --musdb /data/musdb18hq --out exp/dprnn
"""
import argparse
import math
import os
import random
import time
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

SOURCES = ["drums", "bass", "other", "vocals"]
VOCALS = SOURCES.index("vocals")


class AlignedExcerpts(Dataset):
    def __init__(self, tracks, seconds, per_track, sr=44100):
        self.tracks, self.per_track = tracks, per_track
        self.n = int(seconds * sr)
        self.frames = [sf.info(str(t / "mixture.wav")).frames for t in tracks]

    def __len__(self):
        return len(self.tracks) * self.per_track

    def __getitem__(self, i):
        k = i // self.per_track
        off = random.randint(0, max(0, self.frames[k] - self.n))
        out = np.zeros((len(SOURCES), 2, self.n), dtype=np.float32)
        for s, name in enumerate(SOURCES):
            x, _ = sf.read(str(self.tracks[k] / f"{name}.wav"), start=off, frames=self.n, dtype="float32", always_2d=True)
            out[s, :, :len(x)] = x.T
        return torch.from_numpy(out)


class GainRemix:
    """Shuffle every stem independently across the batch and apply a random gain."""

    def __init__(self, min_gain=0.25, max_gain=1.25, flip_prob=0.5, device="cuda:0"):
        self.min_gain, self.max_gain, self.flip_prob = min_gain, max_gain, flip_prob
        self.device = device

    def __call__(self, stems):
        B, S, C, T = stems.shape
        perm = torch.argsort(torch.rand(B, S, device=self.device), dim=0)
        stems = torch.gather(stems, 0, perm[:, :, None, None].expand(B, S, C, T))
        gains = torch.empty(B, S, 1, 1, device=self.device).uniform_(self.min_gain, self.max_gain)
        flip = torch.rand(B, S, 1, 1, device=self.device) < self.flip_prob
        stems = torch.where(flip, stems.flip(2), stems)
        return stems * gains


class DPRNNBlock(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.intra = nn.LSTM(d, h, batch_first=True, bidirectional=True)
        self.intra_fc, self.intra_norm = nn.Linear(2 * h, d), nn.GroupNorm(1, d)
        self.inter = nn.LSTM(d, h, batch_first=True, bidirectional=True)
        self.inter_fc, self.inter_norm = nn.Linear(2 * h, d), nn.GroupNorm(1, d)

    def forward(self, x):  # B D K S  (chunk length K, number of chunks S)
        B, D, K, S = x.shape
        y = x.permute(0, 3, 2, 1).reshape(B * S, K, D)
        y = self.intra_fc(self.intra(y)[0]).reshape(B, S, K, D).permute(0, 3, 2, 1)
        x = x + self.intra_norm(y)
        y = x.permute(0, 2, 3, 1).reshape(B * K, S, D)
        y = self.inter_fc(self.inter(y)[0]).reshape(B, K, S, D).permute(0, 3, 1, 2)
        return x + self.inter_norm(y)


class DPRNN(nn.Module):
    def __init__(self, channels=2, n_src=2, N=256, L=16, D=128, H=128, K=100, layers=6):
        super().__init__()
        self.n_src, self.N, self.L, self.K, self.channels = n_src, N, L, K, channels
        self.encoder = nn.Conv1d(channels, N, L, stride=L // 2, bias=False)
        self.norm = nn.GroupNorm(1, N)
        self.proj = nn.Conv1d(N, D, 1)
        self.blocks = nn.Sequential(*[DPRNNBlock(D, H) for _ in range(layers)])
        self.mask = nn.Sequential(nn.PReLU(), nn.Conv2d(D, n_src * N, 1))
        self.decoder = nn.ConvTranspose1d(N, channels, L, stride=L // 2, bias=False)

    def forward(self, mix):
        B, C, T = mix.shape
        w = F.relu(self.encoder(F.pad(mix, (0, self.L))))
        x = self.proj(self.norm(w))
        frames = x.shape[-1]
        hop = self.K // 2
        pad = (hop - (frames - self.K) % hop) % hop if frames > self.K else self.K - frames
        x = F.pad(x, (0, pad))
        chunks = x.unfold(-1, self.K, hop).permute(0, 1, 3, 2)  # B D K S
        y = self.mask(self.blocks(chunks))  # B nN K S
        S = y.shape[-1]
        over = F.fold(y.reshape(B, -1, S), output_size=(1, frames + pad), kernel_size=(1, self.K), stride=(1, hop))
        m = torch.sigmoid(over.reshape(B, self.n_src, self.N, -1)[..., :frames])
        est = self.decoder((w.unsqueeze(1) * m).reshape(B * self.n_src, self.N, frames))
        return est[..., :T].reshape(B, self.n_src, C, T)


@torch.no_grad()
def separate_track(net, mix, device, seg=44100 * 8, overlap=0.25):
    hop = int(seg * (1 - overlap))
    T = mix.shape[-1]
    n = max(1, math.ceil((T - seg) / hop) + 1)
    x = F.pad(mix, (0, (n - 1) * hop + seg - T))
    ramp = torch.linspace(0, 1, seg - hop + 2)[1:-1]
    win = torch.cat([ramp, torch.ones(2 * hop - seg), ramp.flip(0)])
    out = torch.zeros(2, 2, x.shape[-1])
    norm = torch.zeros(x.shape[-1])
    for i in range(n):
        s = i * hop
        out[..., s:s + seg] += net(x[None, :, s:s + seg].to(device))[0].cpu() * win
        norm[s:s + seg] += win
    return (out / norm.clamp_min(1e-6))[..., :T]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--musdb", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("exp/dprnn"))
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--per-track", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=10)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    valid_names = set((args.musdb / "valid.txt").read_text().split())
    tracks = sorted(p for p in (args.musdb / "train").iterdir() if p.is_dir())
    train_tracks = [t for t in tracks if t.name not in valid_names]
    valid_tracks = [t for t in tracks if t.name in valid_names]

    ds = AlignedExcerpts(train_tracks, args.seconds, args.per_track)
    sampler = DistributedSampler(ds, shuffle=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers, pin_memory=True,
                    drop_last=True, worker_init_fn=lambda w: random.seed(torch.initial_seed() % 2 ** 32 + 31 * rank))
    remix = GainRemix()

    net = DPRNN().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=40, gamma=0.5)

    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for stems in dl:
            stems = remix(stems.to(device, non_blocking=True))
            voc = stems[:, VOCALS]
            acc = stems.sum(1) - voc
            target = torch.stack([voc, acc], 1)
            est = model(voc + acc)
            loss = F.l1_loss(est, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones_like(loss)])
        sched.step()
        dist.all_reduce(tot)
        line = f"epoch {epoch} l1 {(tot[0] / tot[1]).item():.4f} {time.time() - t0:.0f}s"

        if (epoch + 1) % args.eval_every == 0:
            net.eval()
            acc_sdr = torch.zeros(3, device=device)
            for t in valid_tracks[rank::world]:
                stems = np.stack([sf.read(str(t / f"{s}.wav"), dtype="float32", always_2d=True)[0].T for s in SOURCES])
                voc, rest = torch.from_numpy(stems[VOCALS]), torch.from_numpy(stems.sum(0) - stems[VOCALS])
                est = separate_track(net, voc + rest, device)
                for j, ref in enumerate((voc, rest)):
                    acc_sdr[j] += 10 * torch.log10(ref.pow(2).sum() / (ref - est[j]).pow(2).sum().clamp_min(1e-9)).item()
                acc_sdr[2] += 1
            dist.all_reduce(acc_sdr)
            net.train()
            line += f" | SDR vocals {(acc_sdr[0] / acc_sdr[2]).item():.2f} accomp {(acc_sdr[1] / acc_sdr[2]).item():.2f}"

        if rank == 0:
            print(line, flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch}, args.out / "last.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
