"""Solver-style training loop for a compact waveform Demucs (4 stems) on MUSDB18-HQ + extra stems.

    torchrun --nproc_per_node=4 11_htdemucs_valid.py --musdb /data/musdb18hq --extra /data/extra_stems
"""
import argparse
import json
import logging
import math
import os
import random
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger(__name__)


class BLSTM(nn.Module):
    def __init__(self, dim, layers=2):
        super().__init__()
        self.lstm = nn.LSTM(dim, dim, num_layers=layers, bidirectional=True)
        self.linear = nn.Linear(2 * dim, dim)

    def forward(self, x):
        x = x.permute(2, 0, 1)
        x = self.linear(self.lstm(x)[0])
        return x.permute(1, 2, 0)


class Demucs(nn.Module):
    def __init__(self, sources, audio_channels=2, channels=64, depth=6, kernel_size=8, stride=4,
                 samplerate=44100, segment=8.0):
        super().__init__()
        self.sources = sources
        self.audio_channels = audio_channels
        self.samplerate = samplerate
        self.segment = segment
        self.kernel_size, self.stride, self.depth = kernel_size, stride, depth
        self.encoder, self.decoder = nn.ModuleList(), nn.ModuleList()
        in_ch = audio_channels
        for index in range(depth):
            self.encoder.append(nn.Sequential(
                nn.Conv1d(in_ch, channels, kernel_size, stride), nn.ReLU(),
                nn.Conv1d(channels, 2 * channels, 1), nn.GLU(1)))
            out_ch = in_ch if index > 0 else len(sources) * audio_channels
            layers = [nn.Conv1d(channels, 2 * channels, 3, padding=1), nn.GLU(1),
                      nn.ConvTranspose1d(channels, out_ch, kernel_size, stride)]
            if index > 0:
                layers.append(nn.ReLU())
            self.decoder.insert(0, nn.Sequential(*layers))
            in_ch, channels = channels, 2 * channels
        self.lstm = BLSTM(in_ch)

    def valid_length(self, length):
        for _ in range(self.depth):
            length = max(1, math.ceil((length - self.kernel_size) / self.stride) + 1)
        for _ in range(self.depth):
            length = (length - 1) * self.stride + self.kernel_size
        return int(length)

    def forward(self, mix):
        x = mix
        length = x.shape[-1]
        mono = mix.mean(dim=1, keepdim=True)
        mean, std = mono.mean(dim=-1, keepdim=True), mono.std(dim=-1, keepdim=True)
        x = (x - mean) / (1e-5 + std)
        pad = self.valid_length(length) - length
        x = F.pad(x, (pad // 2, pad - pad // 2))
        saved = []
        for encode in self.encoder:
            x = encode(x)
            saved.append(x)
        x = self.lstm(x)
        for decode in self.decoder:
            skip = saved.pop(-1)
            x = decode(x + skip[..., :x.shape[-1]])
        x = x[..., pad // 2: pad // 2 + length]
        x = x.view(x.size(0), len(self.sources), self.audio_channels, length)
        return x * std[:, None] + mean[:, None]


class StemFolder(Dataset):
    """Random remix over a folder of tracks (one wav per stem)."""

    def __init__(self, root, tracks, sources, samplerate, segment, epoch_size):
        self.root, self.tracks, self.sources = Path(root), tracks, sources
        self.length = int(samplerate * segment)
        self.epoch_size = epoch_size
        self.frames = {t: torchaudio.info(str(self.root / t / f"{sources[0]}.wav")).num_frames for t in tracks}

    def __len__(self):
        return self.epoch_size

    def __getitem__(self, index):
        wavs = []
        for source in self.sources:
            track = random.choice(self.tracks)
            offset = random.randint(0, max(0, self.frames[track] - self.length))
            wav, _ = torchaudio.load(str(self.root / track / f"{source}.wav"), frame_offset=offset,
                                     num_frames=self.length)
            wav = F.pad(wav, (0, self.length - wav.shape[-1]))
            wavs.append(wav * random.uniform(0.25, 1.25) * random.choice([-1, 1]))
        return torch.stack(wavs)


def apply_chunked(model, mix, overlap=0.25, device="cpu"):
    segment_len = int(model.segment * model.samplerate)
    stride = int((1 - overlap) * segment_len)
    length = mix.shape[-1]
    out = torch.zeros(len(model.sources), mix.shape[0], length, device=device)
    weight = torch.zeros(length, device=device)
    tri = torch.cat([torch.arange(1, segment_len // 2 + 1), torch.arange(segment_len - segment_len // 2, 0, -1)])
    tri = (tri / tri.max()).to(device)
    for offset in range(0, length, stride):
        chunk = mix[:, offset:offset + segment_len]
        n = chunk.shape[-1]
        chunk = F.pad(chunk, (0, segment_len - n)).to(device)
        with torch.no_grad():
            est = model(chunk[None])[0]
        out[..., offset:offset + n] += est[..., :n] * tri[:n]
        weight[offset:offset + n] += tri[:n]
    return out / weight


class Solver:
    def __init__(self, model, ddp_model, optimizer, loader, sampler, valid_tracks, args, device):
        self.model, self.dmodel = model, ddp_model
        self.optimizer, self.loader, self.sampler = optimizer, loader, sampler
        self.valid_tracks, self.args, self.device = valid_tracks, args, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.history = []
        self.ckpt = Path(args.out) / "checkpoint.th"
        if self.ckpt.exists():
            pkg = torch.load(self.ckpt, map_location="cpu")
            self.model.load_state_dict(pkg["state"])
            self.optimizer.load_state_dict(pkg["optimizer"])
            self.history = pkg["history"]

    def train_epoch(self, epoch):
        self.sampler.set_epoch(epoch)
        self.dmodel.train()
        total = torch.zeros(2, device=self.device)
        for sources in self.loader:
            sources = sources.to(self.device, non_blocking=True)
            estimate = self.dmodel(sources.sum(dim=1))
            loss = F.l1_loss(estimate, sources)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            total += torch.stack([loss.detach(), torch.ones_like(loss)])
        dist.all_reduce(total)
        return (total[0] / total[1]).item()

    def valid_epoch(self):
        self.dmodel.eval()
        sources = self.dmodel.sources
        acc = torch.zeros(len(sources) + 1, device=self.device)
        for track in self.valid_tracks[self.rank::self.world]:
            refs = torch.stack([torchaudio.load(str(track / f"{s}.wav"))[0] for s in sources]).to(self.device)
            est = apply_chunked(self.dmodel, refs.sum(0), overlap=self.args.overlap, device=self.device)
            num = refs.pow(2).sum(dim=(-2, -1))
            den = (refs - est).pow(2).sum(dim=(-2, -1))
            acc[:-1] += 10 * torch.log10((num + 1e-8) / (den + 1e-8))
            acc[-1] += 1
        dist.all_reduce(acc)
        self.dmodel.train()
        return {s: (acc[i] / acc[-1]).item() for i, s in enumerate(sources)}

    def run(self):
        for epoch in range(len(self.history), self.args.epochs):
            metrics = {"train": self.train_epoch(epoch)}
            if (epoch + 1) % self.args.eval_every == 0:
                metrics["valid"] = self.valid_epoch()
            self.history.append(metrics)
            logger.info("epoch %d %s", epoch, json.dumps(metrics))
            if self.rank == 0:
                pkg = {"state": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                       "history": self.history, "args": vars(self.args)}
                torch.save(pkg, str(self.ckpt) + ".tmp")
                os.replace(str(self.ckpt) + ".tmp", self.ckpt)
            dist.barrier()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--musdb", required=True)
    parser.add_argument("--extra", default=None)
    parser.add_argument("--out", default="outputs/demucs_solver")
    parser.add_argument("--epochs", type=int, default=180)
    parser.add_argument("--epoch-size", type=int, default=10000)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--overlap", type=float, default=0.25)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    model = Demucs(["drums", "bass", "other", "vocals"]).to(device)
    musdb = Path(args.musdb)
    with open(musdb / "valid.json") as f:
        valid_names = set(json.load(f))
    train_names = sorted(p.name for p in (musdb / "train").iterdir() if p.name not in valid_names)
    valid_tracks = sorted((musdb / "train") / n for n in valid_names)
    datasets = [StemFolder(musdb / "train", train_names, model.sources, model.samplerate, model.segment, args.epoch_size)]
    if args.extra:
        extra = sorted(p.name for p in Path(args.extra).iterdir() if p.is_dir())
        datasets.append(StemFolder(args.extra, extra, model.sources, model.samplerate, model.segment, args.epoch_size // 2))
    train_set = ConcatDataset(datasets)
    sampler = DistributedSampler(train_set)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True,
                        worker_init_fn=lambda wid: random.seed(torch.initial_seed() % 2 ** 32 + 7919 * rank))

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    ddp_model = DistributedDataParallel(model, device_ids=[local_rank])
    Solver(model, ddp_model, optimizer, loader, sampler, valid_tracks, args, device).run()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
