#!/usr/bin/env python3
"""ECAPA-TDNN speaker verification (SpeechBrain building blocks, plain PyTorch loop).

Trains on VoxCeleb1+2 dev and validates on the VoxCeleb1-E trial list after
every epoch; the checkpoint with the lowest EER is kept as best.ckpt.

    torchrun --nproc_per_node=8 05_ecapa_sb_trials_eval.py \
        --train-csv data/train.csv --trials data/vox1_E_cleaned.txt --wav-root data/vox1/wav
"""
import argparse
import csv
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchaudio
from sklearn.metrics import roc_curve
from speechbrain.lobes.features import Fbank
from speechbrain.lobes.models.ECAPA_TDNN import ECAPA_TDNN, Classifier
from speechbrain.nnet.losses import AdditiveAngularMargin, LogSoftmaxWrapper
from speechbrain.processing.features import InputNormalization
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-csv", required=True)
    ap.add_argument("--trials", required=True)
    ap.add_argument("--wav-root", required=True)
    ap.add_argument("--out", default="exp/ecapa_sb")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--crop-sec", type=float, default=3.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1986)
    return ap.parse_args()


class SpeakerModel(torch.nn.Module):
    def __init__(self, n_spk):
        super().__init__()
        self.fbank = Fbank(n_mels=80)
        self.norm = InputNormalization(norm_type="sentence", std_norm=False)
        self.embedding = ECAPA_TDNN(80, channels=[1024, 1024, 1024, 1024, 3072], lin_neurons=192)
        self.classifier = Classifier(192, out_neurons=n_spk)

    def embed(self, wav):
        feats = self.fbank(wav)
        lens = torch.ones(feats.size(0), device=feats.device)
        feats = self.norm(feats, lens)
        return self.embedding(feats, lens)

    def forward(self, wav):
        return self.classifier(self.embed(wav))


class CsvCrops(Dataset):
    """CSV rows: ID,duration,wav,spk_id (SpeechBrain VoxCeleb prep format)."""

    def __init__(self, csv_path, crop_sec):
        with open(csv_path) as f:
            rows = list(csv.DictReader(f))
        spks = sorted({r["spk_id"] for r in rows})
        self.spk2idx = {s: i for i, s in enumerate(spks)}
        self.rows = [(r["wav"], float(r["duration"]), self.spk2idx[r["spk_id"]]) for r in rows]
        self.crop = int(crop_sec * 16000)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, dur, spk = self.rows[i]
        total = int(dur * 16000)
        off = random.randint(0, max(0, total - self.crop))
        wav, _ = torchaudio.load(path, frame_offset=off, num_frames=self.crop)
        wav = wav[0]
        if wav.numel() < self.crop:
            wav = F.pad(wav, (0, self.crop - wav.numel()))
        return wav, spk


def load_trials(path):
    out = []
    with open(path) as f:
        for line in f:
            lab, e, t = line.split()
            out.append((int(lab), e, t))
    return out


def eer_from_scores(scores, labels):
    fpr, tpr, _ = roc_curve(labels, scores)
    fnr = 1 - tpr
    i = np.nanargmin(np.abs(fpr - fnr))
    return 100.0 * (fpr[i] + fnr[i]) / 2


@torch.no_grad()
def validate(model, trials, wav_root, device):
    model.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    my_trials = trials[rank::world]
    cache = {}

    def emb(utt):
        if utt not in cache:
            wav, _ = torchaudio.load(os.path.join(wav_root, utt))
            cache[utt] = F.normalize(model.embed(wav.to(device)).squeeze(1), dim=-1)[0]
        return cache[utt]

    scores, labels = [], []
    for lab, e, t in my_trials:
        scores.append(float(torch.dot(emb(e), emb(t))))
        labels.append(lab)
    return eer_from_scores(np.array(scores), np.array(labels))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    train = CsvCrops(args.train_csv, args.crop_sec)
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)
    trials = load_trials(args.trials)

    model = SpeakerModel(len(train.spk2idx)).to(device)
    ddp_model = DDP(model, device_ids=[local_rank])
    criterion = LogSoftmaxWrapper(AdditiveAngularMargin(margin=0.2, scale=30))
    # linear scaling of the single-GPU recipe (lr 1e-3 for batch 32)
    opt = torch.optim.Adam(ddp_model.parameters(), lr=args.lr * world, weight_decay=2e-6)
    sched = torch.optim.lr_scheduler.CyclicLR(opt, base_lr=1e-8, max_lr=args.lr * world,
                                              step_size_up=65000 // world, cycle_momentum=False)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_eer = 100.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        t0 = time.time()
        loss_sum = torch.zeros(1, device=device)
        for step, (wav, spk) in enumerate(loader):
            wav, spk = wav.to(device, non_blocking=True), spk.to(device, non_blocking=True)
            out = ddp_model(wav)
            loss = criterion(out, spk.unsqueeze(1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum)
        avg_loss = loss_sum.item() / (world * len(loader))

        eer = validate(model, trials, args.wav_root, device)
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {avg_loss:.4f}  Vox1-E EER {eer:.3f}%  "
                  f"({time.time() - t0:.0f}s)", flush=True)
            ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                    "spk2idx": train.spk2idx, "eer": eer}
            torch.save(ckpt, os.path.join(args.out, "last.ckpt"))
            if eer < best_eer:
                best_eer = eer
                torch.save(ckpt, os.path.join(args.out, "best.ckpt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
