"""Multitrack separation on our in-house stem library.

Every song folder holds drums.flac / bass.flac / other.flac / vocals.flac (no fixed
train/valid split is shipped, we carve one out at startup).

    torchrun --nnodes=1 --nproc_per_node=4 03_remix_demucs_train.py --root /data/stems --out runs/remix_tcn
"""
import argparse
import os
import random
import time
from dataclasses import dataclass, asdict
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
from torch.utils.tensorboard import SummaryWriter

STEMS = ["drums", "bass", "other", "vocals"]


@dataclass
class Config:
    root: str = "/data/stems"
    out: str = "runs/remix_tcn"
    sr: int = 44100
    seconds: float = 6.0
    n_valid: int = 40
    items_per_epoch: int = 20000
    batch_size: int = 6
    lr: float = 5e-4
    epochs: int = 200
    workers: int = 8
    seed: int = 1234
    enc_dim: int = 256
    bottleneck: int = 128
    hidden: int = 512
    blocks: int = 8
    repeats: int = 3
    eval_seconds: float = 30.0


def parse() -> Config:
    cfg = Config()
    p = argparse.ArgumentParser()
    for k, v in asdict(cfg).items():
        p.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    return Config(**vars(p.parse_args()))


class StemRemix(Dataset):
    def __init__(self, songs, cfg, items):
        self.songs = songs
        self.n = int(cfg.seconds * cfg.sr)
        self.items = items
        self.frames = {}
        for s in songs:
            self.frames[s] = min(sf.info(str(s / f"{stem}.flac")).frames for stem in STEMS)

    def __len__(self):
        return self.items

    def _chunk(self, song, stem):
        total = self.frames[song]
        start = random.randint(0, max(0, total - self.n))
        x, _ = sf.read(str(song / f"{stem}.flac"), start=start, frames=self.n, dtype="float32", always_2d=True)
        if len(x) < self.n:
            x = np.pad(x, ((0, self.n - len(x)), (0, 0)))
        return x.T

    def __getitem__(self, idx):
        out = []
        for stem in STEMS:
            x = self._chunk(random.choice(self.songs), stem) * random.uniform(0.3, 1.3)
            if random.random() < 0.5:
                x = x[::-1]
            out.append(np.ascontiguousarray(x))
        return torch.from_numpy(np.stack(out))


class TCNBlock(nn.Module):
    def __init__(self, b, h, dilation):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(b, h, 1), nn.PReLU(), nn.GroupNorm(1, h),
            nn.Conv1d(h, h, 3, padding=dilation, dilation=dilation, groups=h), nn.PReLU(), nn.GroupNorm(1, h),
            nn.Conv1d(h, b, 1))

    def forward(self, x):
        return x + self.net(x)


class StereoTasNet(nn.Module):
    def __init__(self, cfg, n_src=len(STEMS), channels=2, kernel=20):
        super().__init__()
        self.n_src, self.channels, self.kernel = n_src, channels, kernel
        self.encoder = nn.Conv1d(channels, cfg.enc_dim, kernel, stride=kernel // 2, bias=False)
        self.norm = nn.GroupNorm(1, cfg.enc_dim)
        self.inp = nn.Conv1d(cfg.enc_dim, cfg.bottleneck, 1)
        self.tcn = nn.Sequential(*[TCNBlock(cfg.bottleneck, cfg.hidden, 2 ** i)
                                   for _ in range(cfg.repeats) for i in range(cfg.blocks)])
        self.mask = nn.Conv1d(cfg.bottleneck, n_src * cfg.enc_dim, 1)
        self.decoder = nn.ConvTranspose1d(cfg.enc_dim, channels, kernel, stride=kernel // 2, bias=False)

    def forward(self, mix):
        B, _, T = mix.shape
        w = F.relu(self.encoder(mix))
        m = torch.sigmoid(self.mask(self.tcn(self.inp(self.norm(w)))))
        m = m.view(B, self.n_src, -1, w.shape[-1])
        est = self.decoder((m * w.unsqueeze(1)).flatten(0, 1))
        est = F.pad(est, (0, max(0, T - est.shape[-1])))[..., :T]
        return est.view(B, self.n_src, self.channels, T)


def si_sdr_loss(est, ref, eps=1e-8):
    ref = ref - ref.mean(-1, keepdim=True)
    est = est - est.mean(-1, keepdim=True)
    proj = (est * ref).sum(-1, keepdim=True) * ref / (ref.pow(2).sum(-1, keepdim=True) + eps)
    noise = est - proj
    return -10 * torch.log10(proj.pow(2).sum(-1) / (noise.pow(2).sum(-1) + eps) + eps).mean()


@torch.no_grad()
def valid_score(model, songs, cfg, device):
    """Middle excerpt of each validation song, split across ranks; returns mean SDR per stem."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = int(cfg.eval_seconds * cfg.sr)
    acc = torch.zeros(len(STEMS) + 1, device=device)
    model.eval()
    for song in songs[rank::world]:
        frames = min(sf.info(str(song / f"{s}.flac")).frames for s in STEMS)
        start = max(0, frames // 2 - n // 2)
        refs = np.stack([sf.read(str(song / f"{s}.flac"), start=start, frames=n, dtype="float32",
                                 always_2d=True)[0].T for s in STEMS])
        refs = torch.from_numpy(refs).to(device)
        est = model(refs.sum(0, keepdim=True))[0]
        num = refs.pow(2).sum((-2, -1))
        den = (refs - est).pow(2).sum((-2, -1))
        acc[:-1] += 10 * torch.log10((num + 1e-8) / (den + 1e-8))
        acc[-1] += 1
    dist.all_reduce(acc)
    model.train()
    return acc[:-1] / acc[-1].clamp_min(1)


def main():
    cfg = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # different augmentation stream on every GPU
    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed + rank)

    songs = sorted(p for p in Path(cfg.root).iterdir() if (p / "vocals.flac").exists())
    random.shuffle(songs)
    valid_songs, train_songs = songs[:cfg.n_valid], songs[cfg.n_valid:]

    train_set = StemRemix(train_songs, cfg, cfg.items_per_epoch)
    sampler = DistributedSampler(train_set, shuffle=False)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers,
                        pin_memory=True, drop_last=True, worker_init_fn=lambda w: random.seed(cfg.seed + 97 * rank + w + int(time.time())))

    net = StereoTasNet(cfg).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=5)

    writer = None
    out = Path(cfg.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        writer = SummaryWriter(out / "tb")
        print(f"{len(train_songs)} train songs, {len(valid_songs)} valid songs, world size {world}")

    step, best = 0, -float("inf")
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        for stems in loader:
            stems = stems.to(device, non_blocking=True)
            est = model(stems.sum(1))
            loss = si_sdr_loss(est, stems)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            step += 1
            if writer is not None and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), step)

        scores = valid_score(net, valid_songs, cfg, device)
        mean_sdr = scores.mean().item()
        sched.step(mean_sdr)
        if rank == 0:
            for s, v in zip(STEMS, scores.tolist()):
                writer.add_scalar(f"valid/{s}", v, epoch)
            writer.add_scalar("valid/mean", mean_sdr, epoch)
            print(f"epoch {epoch:03d} | {time.time() - tic:6.1f}s | valid SDR {mean_sdr:.2f}", flush=True)
            torch.save({"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict(), "cfg": asdict(cfg)},
                       out / "last.pt")
            if mean_sdr > best:
                best = mean_sdr
                torch.save(net.state_dict(), out / "best.pt")
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
