"""Demucs (non-causal, BLSTM) denoiser on Valentini VoiceBank-DEMAND 16 kHz, Solver-style trainer.

    torchrun --standalone --nproc_per_node=4 19_demucs_valentini_solver.py \
        --noisy_train /data/vb16k/noisy_trainset_28spk_wav --clean_train /data/vb16k/clean_trainset_28spk_wav \
        --noisy_test /data/vb16k/noisy_testset_wav --clean_test /data/vb16k/clean_testset_wav
"""
import argparse
import json
import logging
import math
import os
import random
import time
from pathlib import Path

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

logger = logging.getLogger(__name__)


class NoisyCleanSet(Dataset):
    def __init__(self, noisy_dir, clean_dir, length=None, stride=None, sample_rate=16000):
        self.noisy_dir, self.clean_dir = Path(noisy_dir), Path(clean_dir)
        self.length = int(length * sample_rate) if length else None
        self.stride = int(stride * sample_rate) if stride else None
        self.examples = []
        for f in sorted(self.noisy_dir.glob("*.wav")):
            n = sf.info(str(f)).frames
            if self.length is None:
                self.examples.append((f.name, 0, n))
            else:
                n_ex = max(1, int(math.ceil((n - self.length) / self.stride)) + 1)
                self.examples += [(f.name, i * self.stride, n) for i in range(n_ex)]

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, idx):
        name, offset, n = self.examples[idx]
        frames = self.length or n
        noisy = sf.read(str(self.noisy_dir / name), start=offset, frames=frames, dtype="float32", fill_value=0.0)[0]
        clean = sf.read(str(self.clean_dir / name), start=offset, frames=frames, dtype="float32", fill_value=0.0)[0]
        return torch.from_numpy(noisy), torch.from_numpy(clean)


class Demucs(nn.Module):
    def __init__(self, hidden=64, depth=5, kernel=8, stride=4, growth=2, floor=1e-3):
        super().__init__()
        self.depth, self.kernel, self.stride, self.floor = depth, kernel, stride, floor
        self.encoder, self.decoder = nn.ModuleList(), nn.ModuleList()
        chin = 1
        for i in range(depth):
            self.encoder.append(nn.Sequential(nn.Conv1d(chin, hidden, kernel, stride), nn.ReLU(),
                                              nn.Conv1d(hidden, 2 * hidden, 1), nn.GLU(1)))
            dec = [nn.Conv1d(hidden, 2 * hidden, 1), nn.GLU(1), nn.ConvTranspose1d(hidden, chin, kernel, stride)]
            if i > 0:
                dec.append(nn.ReLU())
            self.decoder.insert(0, nn.Sequential(*dec))
            chin, hidden = hidden, growth * hidden
        self.lstm = nn.LSTM(chin, chin, num_layers=2, bidirectional=True)
        self.lstm_proj = nn.Linear(2 * chin, chin)

    def valid_length(self, n):
        for _ in range(self.depth):
            n = max(math.ceil((n - self.kernel) / self.stride) + 1, 1)
        for _ in range(self.depth):
            n = (n - 1) * self.stride + self.kernel
        return int(n)

    def forward(self, wav):
        x = wav.unsqueeze(1)
        std = x.std(-1, keepdim=True)
        x = x / (self.floor + std)
        n = x.size(-1)
        x = F.pad(x, (0, self.valid_length(n) - n))
        skips = []
        for enc in self.encoder:
            x = enc(x)
            skips.append(x)
        h, _ = self.lstm(x.permute(2, 0, 1))
        x = self.lstm_proj(h).permute(1, 2, 0)
        for dec in self.decoder:
            x = dec(x + skips.pop()[..., : x.size(-1)])
        return (std * x[..., :n]).squeeze(1)


def stft_mag(x, n_fft, hop, win, window):
    return torch.stft(x, n_fft, hop, win, window, return_complex=True).abs().clamp_min(1e-7)


class Solver:
    def __init__(self, args, model, train_dl, sampler, test_set, rank, world, device):
        self.args, self.model, self.train_dl, self.sampler = args, model, train_dl, sampler
        self.test_set, self.rank, self.world, self.device = test_set, rank, world, device
        self.optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
        self.resolutions = [(512, 50, 240), (1024, 120, 600), (2048, 240, 1200)]
        self.windows = {w: torch.hann_window(w, device=device) for _, _, w in self.resolutions}
        self.history = []
        self.checkpoint_file = Path(args.exp) / "checkpoint.th"
        self.best_file = Path(args.exp) / "best.th"
        self.best_state = None
        if self.checkpoint_file.exists():
            package = torch.load(self.checkpoint_file, map_location="cpu")
            self.model.module.load_state_dict(package["model"])
            self.optimizer.load_state_dict(package["optimizer"])
            self.history = package["history"]
            self.best_state = package["best_state"]
            logger.info("Resumed from %s after %d epochs", self.checkpoint_file, len(self.history))

    def _serialize(self):
        package = {"model": self.model.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                   "history": self.history, "best_state": self.best_state, "args": vars(self.args)}
        tmp = str(self.checkpoint_file) + ".tmp"
        torch.save(package, tmp)
        os.rename(tmp, self.checkpoint_file)
        tmp = str(self.best_file) + ".tmp"
        torch.save(self.best_state, tmp)
        os.rename(tmp, self.best_file)
        with open(Path(self.args.exp) / "history.json", "w") as f:
            json.dump(self.history, f, indent=2)

    def loss(self, est, clean):
        total = F.l1_loss(est, clean)
        for n_fft, hop, win in self.resolutions:
            E = stft_mag(est, n_fft, hop, win, self.windows[win])
            C = stft_mag(clean, n_fft, hop, win, self.windows[win])
            total = total + 0.5 * (torch.norm(C - E, p="fro") / torch.norm(C, p="fro")
                                   + F.l1_loss(torch.log(E), torch.log(C))) / len(self.resolutions)
        return total

    def train_epoch(self, epoch):
        self.sampler.set_epoch(epoch)
        self.model.train()
        acc = torch.zeros(2, device=self.device)
        for noisy, clean in self.train_dl:
            noisy, clean = noisy.to(self.device, non_blocking=True), clean.to(self.device, non_blocking=True)
            loss = self.loss(self.model(noisy), clean)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=self.device)])
        dist.all_reduce(acc)
        return (acc[0] / acc[1]).item()

    @torch.no_grad()
    def evaluate(self):
        net = self.model.module
        net.eval()
        acc = torch.zeros(3, device=self.device, dtype=torch.float64)
        for i in range(self.rank, len(self.test_set), self.world):
            noisy, clean = self.test_set[i]
            enh = net(noisy[None].to(self.device))[0].cpu().numpy()
            acc[0] += pesq(16000, clean.numpy(), enh, "wb")
            acc[1] += stoi(clean.numpy(), enh, 16000)
            acc[2] += 1
        dist.all_reduce(acc)
        return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()

    def train(self):
        for epoch in range(len(self.history), self.args.epochs):
            t0 = time.time()
            train_loss = self.train_epoch(epoch)
            metrics = {"epoch": epoch, "train": train_loss}
            if (epoch + 1) % self.args.eval_every == 0 or epoch == self.args.epochs - 1:
                metrics["pesq"], metrics["stoi"] = self.evaluate()
            best_loss = min([h["train"] for h in self.history] + [train_loss])
            if train_loss == best_loss:
                self.best_state = {k: v.detach().cpu().clone() for k, v in self.model.module.state_dict().items()}
            self.history.append(metrics)
            logger.info("epoch %d %s (%.0fs)", epoch, json.dumps(metrics), time.time() - t0)
            self._serialize()
            dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--noisy_train", required=True)
    ap.add_argument("--clean_train", required=True)
    ap.add_argument("--noisy_test", required=True)
    ap.add_argument("--clean_test", required=True)
    ap.add_argument("--exp", default="outputs/demucs_vb")
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--batch_size", type=int, default=16, help="per GPU")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--eval_every", type=int, default=10)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)
    os.makedirs(args.exp, exist_ok=True)
    random.seed(rank)

    train_set = NoisyCleanSet(args.noisy_train, args.clean_train, length=4, stride=1)
    test_set = NoisyCleanSet(args.noisy_test, args.clean_test)
    sampler = DistributedSampler(train_set, shuffle=True)
    train_dl = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True)
    model = DistributedDataParallel(Demucs().to(device), device_ids=[local_rank])
    Solver(args, model, train_dl, sampler, test_set, rank, world, device).train()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
