#!/usr/bin/env python3
# ECAPA-TDNN on VoxCeleb2 + VoxBlink (csv manifests), AAM-softmax, DDP.
#
#   torchrun --nproc_per_node=8 11_ecapa_voxblink_manifest.py \
#       --manifests data/vox2_dev.csv data/voxblink_clean.csv --out exp/ecapa_vb
#
# Manifests: path,speaker,duration   (speaker ids are globally unique across corpora)
import argparse
import csv
import math
import os
import random
import time
from dataclasses import dataclass

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from models import ECAPA_TDNN, Fbank
from metrics import compute_eer, compute_mindcf


@dataclass
class Entry:
    path: str
    spk: str
    dur: float


def read_manifests(paths, min_dur):
    entries = []
    for p in paths:
        with open(p, newline="") as f:
            for row in csv.DictReader(f):
                if float(row["duration"]) >= min_dur:
                    entries.append(Entry(row["path"], row["speaker"], float(row["duration"])))
    return entries


def build_label_map(entries):
    speakers = list(set(e.spk for e in entries))
    return {spk: idx for idx, spk in enumerate(speakers)}


class RandomCropSet(Dataset):
    def __init__(self, entries, spk2label, seconds):
        self.entries = entries
        self.spk2label = spk2label
        self.n = int(seconds * 16000)

    def __len__(self):
        return len(self.entries)

    def __getitem__(self, i):
        e = self.entries[i]
        total = int(e.dur * 16000)
        start = random.randint(0, max(0, total - self.n))
        wav, _ = sf.read(e.path, start=start, frames=self.n, dtype="float32", always_2d=False)
        if wav.shape[0] < self.n:
            wav = np.pad(wav, (0, self.n - wav.shape[0]), mode="wrap")
        return torch.from_numpy(wav), self.spk2label[e.spk]


class AAMLoss(nn.Module):
    def __init__(self, dim, n_cls, m=0.2, s=30.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_cls, dim))
        nn.init.xavier_normal_(self.weight)
        self.s = s
        self.cos_m, self.sin_m = math.cos(m), math.sin(m)
        self.th, self.mm = math.cos(math.pi - m), math.sin(math.pi - m) * m

    def forward(self, x, y):
        cos = F.linear(F.normalize(x), F.normalize(self.weight))
        sin = torch.sqrt((1 - cos ** 2).clamp(0, 1))
        phi = torch.where(cos > self.th, cos * self.cos_m - sin * self.sin_m, cos - self.mm)
        oh = F.one_hot(y, cos.shape[1]).to(cos.dtype)
        logits = self.s * (oh * phi + (1 - oh) * cos)
        return F.cross_entropy(logits, y), (logits.argmax(-1) == y).float().mean()


class Model(nn.Module):
    def __init__(self, n_spk, channels=1024, emb=192):
        super().__init__()
        self.fbank = Fbank(n_mels=80)
        self.ecapa = ECAPA_TDNN(80, C=channels, emb_dim=emb)
        self.aam = AAMLoss(emb, n_spk)

    def embed(self, wav):
        return self.ecapa(self.fbank(wav))

    def forward(self, wav, y):
        return self.aam(self.embed(wav), y)


@torch.no_grad()
def evaluate(model, trial_path, root, device):
    model.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    trials = [ln.split() for ln in open(trial_path)]
    utts = sorted(set(u for t in trials for u in t[1:3]))
    local = {}
    for u in utts[rank::world]:
        wav, _ = sf.read(os.path.join(root, u), dtype="float32")
        local[u] = F.normalize(model.embed(torch.from_numpy(wav)[None].to(device)), dim=1)[0].cpu()
    shards = [None] * world
    dist.all_gather_object(shards, local)
    embs = {k: v for s in shards for k, v in s.items()}
    scores = np.array([float(embs[a] @ embs[b]) for _, a, b in trials])
    labels = np.array([int(t[0]) for t in trials])
    return compute_eer(scores, labels), compute_mindcf(scores, labels, 0.01)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifests", nargs="+", required=True)
    ap.add_argument("--trials", default="data/vox1/veri_test2.txt")
    ap.add_argument("--vox1-root", default="data/vox1/wav")
    ap.add_argument("--out", default="exp/ecapa_vb")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch", type=int, default=150, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-dur", type=float, default=1.0)
    ap.add_argument("--crop", type=float, default=2.0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    entries = read_manifests(args.manifests, args.min_dur)
    spk2label = build_label_map(entries)
    dataset = RandomCropSet(entries, spk2label, args.crop)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = Model(len(spk2label)).to(device)
    ddp_model = DDP(model, device_ids=[local_rank])
    peak_lr = args.lr * math.sqrt(world)
    opt = torch.optim.Adam(ddp_model.parameters(), lr=peak_lr, weight_decay=2e-5)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=peak_lr, epochs=args.epochs,
                                                steps_per_epoch=len(loader), pct_start=0.1)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(entries)} utterances, {len(spk2label)} speakers, {world} GPUs", flush=True)

    best = 1e9
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        tic = time.time()
        tot = torch.zeros(3, device=device)
        for step, (wav, y) in enumerate(loader):
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss, acc = ddp_model(wav, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach(), acc.detach(), torch.ones((), device=device)])
            if step % 500 == 0:
                snap = tot.clone()
                dist.all_reduce(snap)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{len(loader)} loss {snap[0] / snap[2]:.3f} "
                          f"acc {100 * snap[1] / snap[2]:.1f}% ({time.time() - tic:.0f}s)", flush=True)

        eer, mindcf = evaluate(model, args.trials, args.vox1_root, device)
        if rank == 0:
            print(f"epoch {epoch}: EER {eer:.3f}%  minDCF {mindcf:.4f}", flush=True)
            state = {"model": model.state_dict(), "spk2label": spk2label, "epoch": epoch}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if eer < best:
                best = eer
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
