"""Top-level prior over VQ-VAE music codes (Jukebox-style), conditioned on genre and artist.

Codes come from our 44.1 kHz VQ-VAE (top level: 2048 codes at ~43 Hz),
stored as one .npy per track plus metadata.csv (track_id, genre_id, artist_id, split).

    torchrun --nproc_per_node=8 12_jukebox_style_prior.py --codes_root /mnt/shared/vq_top --run_dir /mnt/shared/runs/prior_top
"""
import argparse
import csv
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

N_CODES = 2048


def parse_args():
    parser = argparse.ArgumentParser(description="VQ top-level prior")
    parser.add_argument("--codes_root", type=str, required=True)
    parser.add_argument("--run_dir", type=str, required=True)
    parser.add_argument("--n_ctx", type=int, default=2048)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--n_genres", type=int, default=120)
    parser.add_argument("--n_artists", type=int, default=4000)
    parser.add_argument("--bs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1.5e-4)
    parser.add_argument("--warmup", type=int, default=3000)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--ckpt_every", type=int, default=5000)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class CodeWindows(Dataset):
    def __init__(self, root, split, n_ctx, train=True):
        self.root, self.n_ctx, self.train = root, n_ctx, train
        self.rows = []
        with open(os.path.join(root, "metadata.csv")) as f:
            for row in csv.DictReader(f):
                if row["split"] == split:
                    self.rows.append((row["track_id"], int(row["genre_id"]), int(row["artist_id"])))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        tid, genre, artist = self.rows[i]
        codes = np.load(os.path.join(self.root, "codes", f"{tid}.npy"), mmap_mode="r")
        L = len(codes)
        start = np.random.randint(0, max(1, L - self.n_ctx)) if self.train else 0
        window = np.zeros(self.n_ctx, dtype=np.int64)
        chunk = np.asarray(codes[start:start + self.n_ctx], dtype=np.int64)
        window[:len(chunk)] = chunk
        # position of the window in the track, as a fraction (Jukebox timing conditioning)
        timing = np.array([start / max(L, 1), (start + self.n_ctx) / max(L, 1)], dtype=np.float32)
        n_valid = len(chunk)
        return torch.from_numpy(window), genre, artist, torch.from_numpy(timing), n_valid


class Prior(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.x_emb = nn.Embedding(N_CODES, a.width)
        self.pos = nn.Parameter(torch.randn(a.n_ctx, a.width) * 0.01)
        self.genre = nn.Embedding(a.n_genres, a.width)
        self.artist = nn.Embedding(a.n_artists, a.width)
        self.timing = nn.Sequential(nn.Linear(2, a.width), nn.GELU(), nn.Linear(a.width, a.width))
        self.start_token = nn.Parameter(torch.randn(1, 1, a.width) * 0.01)
        layer = nn.TransformerEncoderLayer(a.width, a.heads, 4 * a.width, 0.0, batch_first=True, norm_first=True)
        self.tf = nn.TransformerEncoder(layer, a.depth, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(a.width)
        self.head = nn.Linear(a.width, N_CODES, bias=False)

    def forward(self, x, genre, artist, timing):
        B, T = x.shape
        cond = (self.genre(genre) + self.artist(artist) + self.timing(timing))[:, None]
        # shift right: the first position sees only the start token + conditioning
        h = torch.cat([self.start_token.expand(B, 1, -1), self.x_emb(x[:, :-1])], 1)
        h = h + self.pos[:T] + cond
        mask = torch.triu(torch.full((T, T), float("-inf"), device=x.device), diagonal=1)
        return self.head(self.ln(self.tf(h, mask=mask, is_causal=True)))


def masked_ce(logits, x, n_valid):
    valid = torch.arange(x.size(1), device=x.device)[None] < n_valid[:, None]
    ce = F.cross_entropy(logits.float().transpose(1, 2), x, reduction="none")
    return (ce * valid).sum(), valid.sum()


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = args.local_rank
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group(backend="nccl")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        torch.manual_seed(1)

        self.train_ds = CodeWindows(args.codes_root, "train", args.n_ctx)
        valid_ds = CodeWindows(args.codes_root, "valid", args.n_ctx, train=False)
        valid_ds.rows = valid_ds.rows[self.rank::self.world]
        self.sampler = DistributedSampler(self.train_ds, shuffle=True, drop_last=True)
        self.train_dl = DataLoader(self.train_ds, batch_size=args.bs, sampler=self.sampler,
                                   num_workers=6, pin_memory=True, drop_last=True)
        self.valid_dl = DataLoader(valid_ds, batch_size=args.bs, num_workers=2)

        self.raw = Prior(args).to(self.device)
        self.model = DDP(self.raw, device_ids=[self.local_rank], output_device=self.local_rank)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
        total = args.epochs * len(self.train_dl)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / args.warmup) * max(0.1, 1 - s / total))
        self.scaler = torch.amp.GradScaler("cuda")
        self.writer = SummaryWriter(os.path.join(args.run_dir, "logs")) if self.rank == 0 else None
        self.step = 0

    def batch_to(self, batch):
        x, g, a, t, n = batch
        dev = self.device
        return x.to(dev, non_blocking=True), g.to(dev), a.to(dev), t.to(dev), n.to(dev)

    def train_epoch(self, epoch):
        self.sampler.set_epoch(epoch)
        self.model.train()
        tic = time.time()
        for batch in self.train_dl:
            x, g, a, t, n = self.batch_to(batch)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = self.model(x, g, a, t)
            s, cnt = masked_ce(logits, x, n)
            loss = s / cnt.clamp(min=1)
            self.opt.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.opt)
            gn = nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.scaler.step(self.opt)
            self.scaler.update()
            self.sched.step()
            self.step += 1
            if self.writer is not None and self.step % 50 == 0:
                self.writer.add_scalar("train/loss", loss.item(), self.step)
                self.writer.add_scalar("train/bits_per_code", loss.item() / math.log(2), self.step)
                self.writer.add_scalar("train/grad_norm", gn.item(), self.step)
                self.writer.add_scalar("train/steps_per_sec", 50 / (time.time() - tic), self.step)
                tic = time.time()
            if self.step % self.args.ckpt_every == 0:
                self.save(f"step_{self.step}.pt")

    @torch.no_grad()
    def validate(self):
        self.raw.eval()
        acc = torch.zeros(2, device=self.device, dtype=torch.float64)
        for batch in self.valid_dl:
            x, g, a, t, n = self.batch_to(batch)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = self.raw(x, g, a, t)
            s, cnt = masked_ce(logits, x, n)
            acc[0] += s
            acc[1] += cnt
        dist.all_reduce(acc)
        self.raw.train()
        return (acc[0] / acc[1]).item()

    def save(self, name):
        if self.rank == 0:
            os.makedirs(self.args.run_dir, exist_ok=True)
            torch.save({"model": self.raw.state_dict(), "opt": self.opt.state_dict(),
                        "scaler": self.scaler.state_dict(), "step": self.step},
                       os.path.join(self.args.run_dir, name))
        dist.barrier()

    def fit(self):
        for epoch in range(self.args.epochs):
            self.train_epoch(epoch)
            val = self.validate()
            if self.rank == 0:
                print(f"epoch {epoch} step {self.step} valid nll {val:.4f} ({val / math.log(2):.3f} bits)",
                      flush=True)
                self.writer.add_scalar("valid/nll", val, self.step)
            self.save("last.pt")
        if self.writer is not None:
            self.writer.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    Trainer(parse_args()).fit()
