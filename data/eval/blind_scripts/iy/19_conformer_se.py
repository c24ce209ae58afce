"""Conformer mask-based speech enhancement with gradient accumulation and bf16 autocast.

Memory per GPU is the limit (long segments, full attention), so each optimizer
step accumulates --accum micro-batches; gradients are only all-reduced on the
last micro-batch (DDP.no_sync on the others). Activations of the conformer
blocks are recomputed in backward (non-reentrant checkpointing).

    torchrun --standalone --nproc_per_node=8 19_conformer_se.py --train-manifest data/train.jsonl \
        --noise-manifest data/noise.jsonl --valid-manifest data/valid.jsonl --exp exp/conformer_se
"""
import argparse
import contextlib
import json
import math
import os
import random

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pesq import pesq
from pystoi import stoi
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

SR, N_FFT, HOP = 16000, 512, 128


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


class ManifestMix(Dataset):
    def __init__(self, speech, noise, seconds=6.0, snr=(-5.0, 20.0)):
        self.speech, self.noise = speech, noise
        self.n, self.snr = int(seconds * SR), snr

    def __len__(self):
        return len(self.speech)

    def _segment(self, item):
        if item["frames"] <= self.n:
            x, _ = sf.read(item["path"], dtype="float32")
            return np.pad(x, (0, self.n - len(x)))
        st = random.randint(0, item["frames"] - self.n)
        return sf.read(item["path"], start=st, frames=self.n, dtype="float32")[0]

    def __getitem__(self, i):
        s = self._segment(self.speech[i])
        v = self._segment(random.choice(self.noise))
        snr = random.uniform(*self.snr)
        v = v * np.sqrt((s ** 2).mean() / ((v ** 2).mean() + 1e-9)) * 10 ** (-snr / 20)
        return torch.from_numpy((s + v).astype(np.float32)), torch.from_numpy(s.astype(np.float32))


class ConformerBlock(nn.Module):
    def __init__(self, d, heads=4, kernel=31, dropout=0.1):
        super().__init__()
        self.ff1 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.SiLU(), nn.Dropout(dropout),
                                 nn.Linear(4 * d, d))
        self.attn_norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)
        self.conv_norm = nn.LayerNorm(d)
        self.conv = nn.Sequential(nn.Conv1d(d, 2 * d, 1), nn.GLU(1),
                                  nn.Conv1d(d, d, kernel, padding=kernel // 2, groups=d),
                                  nn.GroupNorm(1, d), nn.SiLU(), nn.Conv1d(d, d, 1))
        self.ff2 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.SiLU(), nn.Dropout(dropout),
                                 nn.Linear(4 * d, d))
        self.out_norm = nn.LayerNorm(d)

    def forward(self, x):
        x = x + 0.5 * self.ff1(x)
        h = self.attn_norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.conv(self.conv_norm(x).transpose(1, 2)).transpose(1, 2)
        x = x + 0.5 * self.ff2(x)
        return self.out_norm(x)


class ConformerSE(nn.Module):
    def __init__(self, d=256, layers=8, grad_ckpt=True):
        super().__init__()
        f = N_FFT // 2 + 1
        self.grad_ckpt = grad_ckpt
        self.inp = nn.Linear(f, d)
        self.blocks = nn.ModuleList([ConformerBlock(d) for _ in range(layers)])
        self.mask = nn.Linear(d, f)

    def forward(self, mag):
        # mag: B, F, T  ->  mask B, F, T
        x = self.inp(torch.log1p(mag).transpose(1, 2))
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return torch.sigmoid(self.mask(x)).transpose(1, 2)


def mr_stft_loss(est, ref, res=((512, 128), (1024, 256), (2048, 512))):
    total = 0.0
    for n, h in res:
        w = torch.hann_window(n, device=est.device)
        E = torch.stft(est, n, h, window=w, return_complex=True).abs().clamp_min(1e-7)
        R = torch.stft(ref, n, h, window=w, return_complex=True).abs().clamp_min(1e-7)
        total = total + (R - E).norm() / R.norm() + F.l1_loss(E.log(), R.log())
    return total / len(res)


@torch.no_grad()
def enhance(net, wav, window, chunk=12 * SR, ctx=2 * SR):
    """Full-utterance enhancement; long inputs are split into chunks with context on both sides."""
    out = torch.empty_like(wav)
    for st in range(0, wav.numel(), chunk):
        a, b = max(0, st - ctx), min(wav.numel(), st + chunk + ctx)
        seg = wav[a:b]
        spec = torch.stft(seg, N_FFT, HOP, window=window, return_complex=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            mask = net(spec.abs()[None])[0]
        y = torch.istft(spec * mask.float(), N_FFT, HOP, window=window, length=seg.numel())
        n = min(chunk, wav.numel() - st)
        out[st:st + n] = y[st - a:st - a + n]
    return out


@torch.no_grad()
def validate(net, items, window, device):
    net.eval()
    acc = torch.zeros(3, dtype=torch.float64, device=device)
    for it in items:
        noisy, _ = sf.read(it["noisy"], dtype="float32")
        clean, _ = sf.read(it["clean"], dtype="float32")
        est = enhance(net, torch.from_numpy(noisy).to(device), window).cpu().numpy()
        acc[0] += pesq(SR, clean, est, "wb")
        acc[1] += stoi(clean, est, SR)
        acc[2] += 1
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-manifest", required=True)
    ap.add_argument("--noise-manifest", required=True)
    ap.add_argument("--valid-manifest", required=True)
    ap.add_argument("--exp", default="exp/conformer_se")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=4, help="micro-batch per GPU")
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-4, help="peak lr for a global batch of 128")
    ap.add_argument("--warmup-steps", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(5)
    random.seed(5 + rank)

    ds = ManifestMix(read_jsonl(args.train_manifest), read_jsonl(args.noise_manifest))
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                    pin_memory=True, drop_last=True, persistent_workers=True)
    valid = read_jsonl(args.valid_manifest)[rank::world]

    net = ConformerSE().to(device)
    model = DDP(net, device_ids=[local_rank])
    global_batch = args.batch_size * args.accum * world
    peak_lr = args.lr * global_batch / 128
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.98), weight_decay=1e-2)
    steps_per_epoch = len(dl) // args.accum
    total = args.epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup_steps, 0.5 * (1 + math.cos(math.pi * min(s / total, 1.0)))))
    window = torch.hann_window(N_FFT, device=device)

    start_epoch, best = 0, 0.0
    ckpt_path = os.path.join(args.exp, "last.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
    writer = None
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.exp, "tb"))
        print(f"global batch {global_batch}, peak lr {peak_lr:.2e}, {steps_per_epoch} steps/epoch", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        opt.zero_grad(set_to_none=True)
        for i, (noisy, clean) in enumerate(dl):
            if i >= steps_per_epoch * args.accum:
                break  # same number of optimizer steps on every rank; drop the ragged tail
            noisy, clean = noisy.to(device, non_blocking=True), clean.to(device, non_blocking=True)
            last_micro = (i + 1) % args.accum == 0
            sync = contextlib.nullcontext() if last_micro else model.no_sync()
            with sync:
                spec = torch.stft(noisy, N_FFT, HOP, window=window, return_complex=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    mask = model(spec.abs())
                est = torch.istft(spec * mask.float(), N_FFT, HOP, window=window, length=noisy.shape[-1])
                loss = mr_stft_loss(est, clean) + F.l1_loss(est, clean)
                (loss / args.accum).backward()
            if last_micro:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                if writer is not None and sched.last_epoch % 50 == 0:
                    writer.add_scalar("train/loss", loss.item(), sched.last_epoch)
                    writer.add_scalar("train/lr", sched.get_last_lr()[0], sched.last_epoch)

        p, s = validate(net, valid, window, device)
        if rank == 0:
            writer.add_scalar("valid/pesq", p, epoch)
            writer.add_scalar("valid/stoi", s, epoch)
            print(f"epoch {epoch}: PESQ {p:.3f} STOI {s:.4f}", flush=True)
            best = max(best, p)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best": best}, ckpt_path)
            if p >= best:
                torch.save(net.state_dict(), os.path.join(args.exp, "best.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
