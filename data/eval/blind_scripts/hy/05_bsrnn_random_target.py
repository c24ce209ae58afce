"""
Shared-trunk Band-Split RNN with one mask estimator per stem.

Each training batch picks a target stem; the mixture is built on the fly from random
stems of random songs (MUSDB18-HQ + MoisesDB converted to the 4-stem layout).

    torchrun --nproc_per_node=8 05_bsrnn_random_target.py --data /data/sep4 --exp exp/bsrnn_shared
"""
import argparse
import glob
import json
import os
import random
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TARGETS = ["vocals", "drums", "bass", "other"]


def make_bands(n_fft=2048, sr=44100):
    widths_hz = [100] * 10 + [250] * 12 + [500] * 8 + [1000] * 8 + [2000] * 2
    edges, f = [0], 0.0
    for w in widths_hz:
        f += w
        edges.append(min(n_fft // 2 + 1, int(round(f * n_fft / sr))))
    edges.append(n_fft // 2 + 1)
    return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]


class BandSequence(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.norm1 = nn.GroupNorm(1, dim)
        self.rnn1 = nn.LSTM(dim, hidden, batch_first=True, bidirectional=True)
        self.fc1 = nn.Linear(2 * hidden, dim)
        self.norm2 = nn.GroupNorm(1, dim)
        self.rnn2 = nn.LSTM(dim, hidden, batch_first=True, bidirectional=True)
        self.fc2 = nn.Linear(2 * hidden, dim)

    def forward(self, z):
        b, k, t, d = z.shape
        h = self.norm1(z.reshape(b * k, t, d).transpose(1, 2)).transpose(1, 2)
        z = z + self.fc1(self.rnn1(h)[0]).reshape(b, k, t, d)
        h = z.permute(0, 2, 1, 3).reshape(b * t, k, d)
        h = self.norm2(h.transpose(1, 2)).transpose(1, 2)
        z = z + self.fc2(self.rnn2(h)[0]).reshape(b, t, k, d).permute(0, 2, 1, 3)
        return z


class MaskHead(nn.Module):
    def __init__(self, bands, dim, channels=2):
        super().__init__()
        self.bands = bands
        self.mlps = nn.ModuleList([
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Tanh(),
                          nn.Linear(4 * dim, 2 * 2 * channels * (hi - lo)), nn.GLU(dim=-1))
            for lo, hi in bands])

    def forward(self, z, channels):
        b, k, t, _ = z.shape
        out = [m(z[:, i]).reshape(b, t, channels, hi - lo, 2) for i, ((lo, hi), m) in enumerate(zip(self.bands, self.mlps))]
        return torch.view_as_complex(torch.cat(out, dim=3).permute(0, 2, 3, 1, 4).contiguous())


class SharedBSRNN(nn.Module):
    def __init__(self, targets, n_fft=2048, hop=441, dim=128, hidden=256, depth=8, channels=2):
        super().__init__()
        self.n_fft, self.hop, self.channels = n_fft, hop, channels
        self.bands = make_bands(n_fft)
        self.split = nn.ModuleList([
            nn.Sequential(nn.LayerNorm(2 * channels * (hi - lo)), nn.Linear(2 * channels * (hi - lo), dim))
            for lo, hi in self.bands])
        self.trunk = nn.Sequential(*[BandSequence(dim, hidden) for _ in range(depth)])
        self.heads = nn.ModuleDict({t: MaskHead(self.bands, dim, channels) for t in targets})
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)

    def stft(self, x):
        b, c, n = x.shape
        s = torch.stft(x.reshape(b * c, n), self.n_fft, self.hop, window=self.window, return_complex=True)
        return s.reshape(b, c, s.shape[-2], s.shape[-1])

    def forward(self, mix, target):
        b, c, n = mix.shape
        spec = self.stft(mix)
        ri = torch.view_as_real(spec).permute(0, 3, 1, 2, 4)  # b t c f 2
        t = ri.shape[1]
        z = torch.stack([proj(ri[:, :, :, lo:hi].reshape(b, t, -1))
                         for (lo, hi), proj in zip(self.bands, self.split)], dim=1)
        z = self.trunk(z)
        mask = self.heads[target](z, c)
        est = (spec * mask).reshape(b * c, spec.shape[-2], spec.shape[-1])
        wav = torch.istft(est, self.n_fft, self.hop, window=self.window, length=n)
        return wav.reshape(b, c, n)


class RandomMix(Dataset):
    def __init__(self, root, split, seconds, items, sr=44100):
        meta = json.load(open(os.path.join(root, f"{split}.json")))
        self.songs = [(os.path.join(root, m["name"]), m["frames"]) for m in meta]
        self.n = int(seconds * sr)
        self.items = items

    def __len__(self):
        return self.items

    def read(self, song, stem):
        path, frames = song
        off = random.randint(0, max(0, frames - self.n))
        x, _ = sf.read(os.path.join(path, stem + ".wav"), start=off, frames=self.n, dtype="float32", always_2d=True)
        x = np.pad(x, ((0, self.n - len(x)), (0, 0)))
        return torch.from_numpy(x.T.copy()) * random.uniform(0.4, 1.2)

    def __getitem__(self, i):
        return torch.stack([self.read(random.choice(self.songs), stem) for stem in TARGETS])


def multi_res_stft_loss(est, ref, window_sizes=(4096, 2048, 1024, 512)):
    loss = 0.0
    e, r = est.flatten(0, 1), ref.flatten(0, 1)
    for n in window_sizes:
        w = torch.hann_window(n, device=est.device)
        E = torch.stft(e, n, n // 4, window=w, return_complex=True)
        R = torch.stft(r, n, n // 4, window=w, return_complex=True)
        loss = loss + (E - R).abs().mean()
    return loss / len(window_sizes)


def init_worker(wid):
    seed = (torch.initial_seed() + wid) % (2 ** 32)
    random.seed(seed)
    np.random.seed(seed)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--exp", required=True)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--items", type=int, default=40000)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--num-workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    torch.manual_seed(17)
    model = SharedBSRNN(TARGETS, depth=args.depth).to(dev)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.98)

    # per-rank streams for the remix augmentation and the target choice
    torch.manual_seed(17 + rank)
    random.seed(17 + rank)
    train = RandomMix(args.data, "train", args.seconds, args.items)
    sampler = DistributedSampler(train)
    loader = DataLoader(train, batch_size=args.bs, sampler=sampler, num_workers=args.num_workers,
                        worker_init_fn=init_worker, pin_memory=True, drop_last=True, persistent_workers=True)

    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
        with open(os.path.join(args.exp, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    start = 0
    ckpts = sorted(glob.glob(os.path.join(args.exp, "epoch_*.pt")))
    if ckpts:
        state = torch.load(ckpts[-1], map_location=dev)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = state["epoch"] + 1

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        stats = torch.zeros(len(TARGETS), 2, device=dev)
        t0 = time.time()
        for it, stems in enumerate(loader):
            stems = stems.to(dev, non_blocking=True)
            k = random.randrange(len(TARGETS))
            mix = stems.sum(1)
            est = ddp(mix, TARGETS[k])
            ref = stems[:, k]
            loss = F.l1_loss(est, ref) + multi_res_stft_loss(est, ref)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 5.0)
            opt.step()
            stats[k, 0] += loss.detach()
            stats[k, 1] += 1
            if rank == 0 and it % 200 == 0:
                print(f"ep {epoch} it {it}/{len(loader)} {TARGETS[k]} loss {loss.item():.4f}", flush=True)
        sched.step()
        dist.all_reduce(stats)
        if rank == 0:
            per = {t: (stats[i, 0] / stats[i, 1].clamp_min(1)).item() for i, t in enumerate(TARGETS)}
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s: " + json.dumps(per), flush=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.exp, f"epoch_{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
