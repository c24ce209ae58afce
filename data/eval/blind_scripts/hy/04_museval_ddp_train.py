#!/usr/bin/env python
# Hybrid Demucs (torchaudio implementation) trained with DDP, evaluated with museval
# (SiSEC18 protocol: median over 1 s windows, then median over tracks is what the paper
# tables report; we log the mean of per-track medians for speed).
#
#   torchrun --standalone --nproc_per_node=8 04_museval_ddp_train.py --musdb /datasets/musdb18hq
import argparse
import functools
import math
import os
import random
import time

import musdb
import museval
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchaudio.models import hdemucs_low
from torchaudio.transforms import Fade

SOURCES = ["drums", "bass", "other", "vocals"]
SR = 44100


class MusdbRemix(Dataset):
    def __init__(self, mus, seconds, items):
        self.mus = mus
        self.seconds = seconds
        self.items = items

    def __len__(self):
        return self.items

    def __getitem__(self, idx):
        stems = []
        for name in SOURCES:
            track = random.choice(self.mus.tracks)
            track.chunk_duration = self.seconds
            track.chunk_start = random.uniform(0, max(0.0, track.duration - self.seconds))
            audio = track.targets[name].audio.T.astype(np.float32)
            audio = audio * random.uniform(0.25, 1.25)
            if random.random() < 0.5:
                audio = audio[::-1].copy()
            stems.append(torch.from_numpy(audio))
        return torch.stack(stems)


def seed_worker(worker_id, rank=0):
    s = (torch.initial_seed() + 7919 * rank) % 2 ** 32
    random.seed(s)
    np.random.seed(s)


@torch.no_grad()
def separate_sources(model, mix, segment=10.0, overlap=0.1, device=None):
    """Chunked inference with linear cross-fade, adapted from the torchaudio HDemucs tutorial."""
    batch, channels, length = mix.shape
    chunk_len = int(SR * segment * (1 + overlap))
    start, end = 0, chunk_len
    overlap_frames = overlap * SR
    fade = Fade(fade_in_len=0, fade_out_len=int(overlap_frames), fade_shape="linear")
    final = torch.zeros(batch, len(SOURCES), channels, length, device=device)
    while start < length - overlap_frames:
        chunk = mix[:, :, start:end].to(device)
        out = fade(model(chunk))
        final[:, :, :, start:end] += out
        if start == 0:
            fade.fade_in_len = int(overlap_frames)
            start += int(chunk_len - overlap_frames)
        else:
            start += chunk_len
        end += chunk_len
        if end >= length:
            fade.fade_out_len = 0
    return final


def evaluate(net, mus_test, device, rank, world):
    net.eval()
    sums = np.zeros(len(SOURCES))
    count = 0
    for i in range(rank, len(mus_test.tracks), world):
        track = mus_test.tracks[i]
        mix = torch.from_numpy(track.audio.T.astype(np.float32)).unsqueeze(0)
        ref = mix.mean(0)
        mix = (mix - ref.mean()) / ref.std()
        est = separate_sources(net, mix, device=device)[0]
        est = (est * ref.std() + ref.mean()).cpu().numpy()
        refs = np.stack([track.targets[s].audio for s in SOURCES])
        ests = np.stack([e.T for e in est])
        sdr, _, _, _ = museval.evaluate(refs, ests, win=SR, hop=SR)
        sums += np.nanmedian(sdr, axis=1)
        count += 1
    totals = torch.tensor(np.append(sums, count), dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    net.train()
    return totals[:-1] / totals[-1]


def cosine_lr(step, total, warmup, base):
    if step < warmup:
        return base * step / warmup
    return 0.5 * base * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--musdb", required=True)
    ap.add_argument("--out", default="checkpoints/hdemucs_low")
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--items", type=int, default=8000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=7.8)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    mus_train = musdb.DB(root=args.musdb, subsets="train", split="train", is_wav=True)
    mus_valid = musdb.DB(root=args.musdb, subsets="train", split="valid", is_wav=True)

    ds = MusdbRemix(mus_train, args.seconds, args.items)
    sampler = DistributedSampler(ds)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=args.workers,
                        worker_init_fn=functools.partial(seed_worker, rank=rank), pin_memory=True, drop_last=True, persistent_workers=True)

    net = hdemucs_low(sources=SOURCES).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    total_steps = args.epochs * len(loader)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step = 0
    best = -1e9
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros((), device=device)
        for stems in loader:
            stems = stems.to(device, non_blocking=True)
            mix = stems.sum(1)
            ref = mix.mean(1, keepdim=True)
            mean, std = ref.mean(-1, keepdim=True), ref.std(-1, keepdim=True) + 1e-5
            for g in opt.param_groups:
                g["lr"] = cosine_lr(step, total_steps, args.warmup, args.lr)
            est = model((mix - mean) / std)
            loss = F.l1_loss(est, (stems - mean.unsqueeze(1)) / std.unsqueeze(1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            loss_sum += loss.detach()
            step += 1
        dist.all_reduce(loss_sum)
        if rank == 0:
            print(f"[{epoch}] loss={loss_sum.item() / (world * len(loader)):.4f} "
                  f"lr={opt.param_groups[0]['lr']:.2e} {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.eval_every == 0:
            sdr = evaluate(net, mus_valid, device, rank, world)
            if rank == 0:
                print("valid SDR " + ", ".join(f"{s}: {v:.2f}" for s, v in zip(SOURCES, sdr.tolist()))
                      + f" | avg {sdr.mean():.2f}", flush=True)
                ckpt = {"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "step": step}
                torch.save(ckpt, os.path.join(args.out, "last.pt"))
                if sdr.mean() > best:
                    best = sdr.mean().item()
                    torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
