#!/usr/bin/env python3
"""Wake-word TC-ResNet8 with a DET evaluation on long-form recordings.

Every epoch, each rank runs a sliding 1 s window (100 ms hop) over its share
of the long-form dev recordings (living-room sessions with annotated wake-word
events), keeps the local score maxima as candidate detections, and rank 0
builds the DET curve from everyone's detections and reports the miss rate at
0.5 false accepts per hour.

    torchrun --nproc_per_node=8 19_det_curve_longform.py --train-csv data/ww_train.csv \
        --longform data/longform_dev --exp exp/tcres8_ww
"""
import argparse
import csv
import glob
import json
import os
import random

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SR = 16000
WIN, HOP = SR, SR // 10


class WakeWordCSV(Dataset):
    def __init__(self, csv_path, noise_dir):
        with open(csv_path) as f:
            self.rows = [(r["path"], int(r["is_wakeword"])) for r in csv.DictReader(f)]
        self.noise = sorted(glob.glob(os.path.join(noise_dir, "*.wav")))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, y = self.rows[i]
        wav, _ = sf.read(path, dtype="float32")
        if len(wav) > WIN:
            o = random.randint(0, len(wav) - WIN)
            wav = wav[o:o + WIN]
        else:
            lead = random.randint(0, WIN - len(wav))
            wav = np.pad(wav, (lead, WIN - len(wav) - lead))
        if self.noise and random.random() < 0.8:
            info = sf.info(random.choice(self.noise))
            start = random.randint(0, max(0, info.frames - WIN))
            nz, _ = sf.read(info.name, start=start, frames=WIN, dtype="float32", fill_value=0.0)
            snr = random.uniform(-3, 18)
            wav = wav + nz * np.sqrt((wav ** 2).mean() / ((nz ** 2).mean() + 1e-9) / 10 ** (snr / 10))
        return torch.from_numpy(wav.astype(np.float32)), float(y)


class Res(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv1d(cin, cout, 9, stride, 4, bias=False)
        self.b1 = nn.BatchNorm1d(cout)
        self.c2 = nn.Conv1d(cout, cout, 9, 1, 4, bias=False)
        self.b2 = nn.BatchNorm1d(cout)
        self.sc = nn.Sequential(nn.Conv1d(cin, cout, 1, stride, bias=False), nn.BatchNorm1d(cout))

    def forward(self, x):
        return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))) + self.sc(x))


class TCResNet8(nn.Module):
    def __init__(self, n_mfcc=40, k=1.5):
        super().__init__()
        c = [int(v * k) for v in (16, 24, 32, 48)]
        self.mfcc = torchaudio.transforms.MFCC(SR, n_mfcc=n_mfcc, melkwargs={"n_fft": 480, "hop_length": 160,
                                                                              "n_mels": 40})
        self.conv = nn.Conv1d(n_mfcc, c[0], 3, padding=1, bias=False)
        self.blocks = nn.Sequential(Res(c[0], c[1], 2), Res(c[1], c[2], 2), Res(c[2], c[3], 2))
        self.fc = nn.Linear(c[3], 1)

    def forward(self, wav):
        return self.fc(self.blocks(self.conv(self.mfcc(wav))).mean(-1)).squeeze(-1)


@torch.no_grad()
def score_recording(net, path, device, batch=512):
    audio, _ = sf.read(path, dtype="float32")
    audio = torch.from_numpy(audio).to(device)
    windows = audio.unfold(0, WIN, HOP)  # (N, WIN)
    scores = torch.cat([torch.sigmoid(net(windows[i:i + batch])) for i in range(0, len(windows), batch)])
    # local maxima above a floor become candidate detections
    is_peak = (scores[1:-1] >= scores[:-2]) & (scores[1:-1] > scores[2:]) & (scores[1:-1] > 0.1)
    peak_idx = is_peak.nonzero().flatten() + 1
    with open(path.replace(".wav", ".events.json")) as f:
        events = json.load(f)
    times = (peak_idx.float() * HOP + WIN / 2) / SR
    hit = torch.zeros_like(times, dtype=torch.bool)
    for start, end in events:
        hit |= (times >= start - 0.3) & (times <= end + 0.5)
    return scores[peak_idx], hit, len(events), audio.numel() / SR


def det_at_far(scores, hits, n_events, hours, target=0.5):
    order = torch.argsort(scores, descending=True)
    hits = hits[order].float()
    fa = torch.cumsum(1 - hits, 0) / hours
    detected = torch.cumsum(hits, 0)
    ok = (fa <= target).nonzero().flatten()
    if len(ok) == 0:
        return 1.0, float("nan")
    i = ok[-1]
    return 1.0 - min(detected[i].item(), n_events) / n_events, scores[order][i].item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-csv", required=True)
    ap.add_argument("--noise-dir", default="/data/noise/home")
    ap.add_argument("--longform", required=True)
    ap.add_argument("--exp", default="exp/tcres8_ww")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--pos-weight", type=float, default=3.0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)
    np.random.seed(rank)

    train_set = WakeWordCSV(args.train_csv, args.noise_dir)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True)
    recordings = sorted(glob.glob(os.path.join(args.longform, "*.wav")))
    my_recordings = recordings[rank::world]

    model = DDP(TCResNet8().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)
    pos_weight = torch.tensor([args.pos_weight], device=device)
    os.makedirs(args.exp, exist_ok=True)

    best_miss = 1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for wav, y in loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(wav), y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        net = model.module.eval()
        scores, hits = [], []
        totals = torch.zeros(2, device=device)  # events, seconds
        for path in my_recordings:
            s, h, n_ev, secs = score_recording(net, path, device)
            scores.append(s)
            hits.append(h)
            totals += torch.tensor([n_ev, secs], device=device)
        scores = torch.cat(scores) if scores else torch.zeros(0, device=device)
        hits = torch.cat(hits) if hits else torch.zeros(0, dtype=torch.bool, device=device)

        dist.all_reduce(totals)
        all_scores = [torch.zeros_like(scores) for _ in range(world)]
        all_hits = [torch.zeros_like(hits) for _ in range(world)]
        dist.all_gather(all_scores, scores)
        dist.all_gather(all_hits, hits)

        if rank == 0:
            n_events, hours = int(totals[0].item()), totals[1].item() / 3600
            miss, thr = det_at_far(torch.cat(all_scores), torch.cat(all_hits), n_events, hours)
            print(f"epoch {epoch}: loss {loss.item():.4f}  miss@0.5FA/h {miss * 100:.2f}% "
                  f"(thr {thr:.3f}, {n_events} events, {hours:.1f} h)", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "miss": miss, "threshold": thr},
                       os.path.join(args.exp, "last.pt"))
            if miss < best_miss:
                best_miss = miss
                torch.save({"model": model.module.state_dict(), "threshold": thr},
                           os.path.join(args.exp, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
