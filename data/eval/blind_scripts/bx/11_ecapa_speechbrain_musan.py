#!/usr/bin/env python3
"""ECAPA-TDNN (SpeechBrain lobes) + AAM-softmax, trained with a hand-written DDP loop.

On-the-fly MUSAN noise augmentation, 3 s random crops, EER on VoxCeleb1-O every epoch.

    torchrun --nproc_per_node=4 11_ecapa_speechbrain_musan.py --exp exp/ecapa_c1024
"""
import argparse
import glob
import math
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from speechbrain.lobes.features import Fbank
from speechbrain.lobes.models.ECAPA_TDNN import ECAPA_TDNN
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SR = 16000


class AdditiveAngularMargin(nn.Module):
    def __init__(self, in_dim, n_classes, margin=0.2, scale=30.0, easy_margin=False):
        super().__init__()
        self.weight = nn.Parameter(torch.FloatTensor(n_classes, in_dim))
        nn.init.xavier_uniform_(self.weight)
        self.margin, self.scale, self.easy_margin = margin, scale, easy_margin

    def forward(self, x, y):
        cosine = F.linear(F.normalize(x), F.normalize(self.weight))
        sine = torch.sqrt((1.0 - cosine ** 2).clamp(1e-9, 1.0))
        phi = cosine * math.cos(self.margin) - sine * math.sin(self.margin)
        if self.easy_margin:
            phi = torch.where(cosine > 0, phi, cosine)
        else:
            phi = torch.where(cosine > math.cos(math.pi - self.margin), phi,
                              cosine - math.sin(math.pi - self.margin) * self.margin)
        onehot = F.one_hot(y, cosine.size(1)).float()
        return F.cross_entropy(self.scale * (onehot * phi + (1 - onehot) * cosine), y)


class SpeakerModel(nn.Module):
    def __init__(self, n_spk, channels=1024, emb=192):
        super().__init__()
        self.fbank = Fbank(n_mels=80)
        self.ecapa = ECAPA_TDNN(input_size=80, channels=[channels] * 4 + [channels * 3], lin_neurons=emb)
        self.aam = AdditiveAngularMargin(emb, n_spk)

    def embed(self, wav):
        feats = self.fbank(wav)
        feats = feats - feats.mean(dim=1, keepdim=True)
        return self.ecapa(feats).squeeze(1)

    def forward(self, wav, y):
        return self.aam(self.embed(wav), y)


class VoxTrainSet(Dataset):
    def __init__(self, root, noise_dir, seconds=3.0):
        self.files = sorted(glob.glob(os.path.join(root, "id*", "*", "*.wav")))
        spks = sorted({p.split(os.sep)[-3] for p in self.files})
        self.spk2id = {s: i for i, s in enumerate(spks)}
        self.noises = sorted(glob.glob(os.path.join(noise_dir, "**", "*.wav"), recursive=True))
        self.n = int(seconds * SR)

    def __len__(self):
        return len(self.files)

    def _crop(self, wav):
        if wav.numel() < self.n:
            wav = wav.repeat(self.n // wav.numel() + 1)
        s = random.randint(0, wav.numel() - self.n)
        return wav[s:s + self.n]

    def __getitem__(self, i):
        path = self.files[i]
        wav, _ = torchaudio.load(path)
        wav = self._crop(wav[0])
        if self.noises and random.random() < 0.6:
            noise, _ = torchaudio.load(random.choice(self.noises))
            noise = self._crop(noise[0])
            snr = torch.tensor([random.uniform(0, 15)])
            wav = torchaudio.functional.add_noise(wav[None], noise[None], snr)[0]
        return wav, self.spk2id[path.split(os.sep)[-3]]


def eer_from_scores(scores, labels):
    order = np.argsort(-scores)
    labels = labels[order]
    tp = np.cumsum(labels)
    fp = np.cumsum(1 - labels)
    fnr = 1 - tp / labels.sum()
    fpr = fp / (1 - labels).sum()
    idx = np.argmin(np.abs(fnr - fpr))
    return float((fnr[idx] + fpr[idx]) / 2)


@torch.no_grad()
def voxceleb1_eer(model, trials_path, wav_dir, rank, world, device):
    trials = [line.split() for line in open(trials_path)]
    utts = sorted({t[1] for t in trials} | {t[2] for t in trials})
    model.eval()
    local = {}
    for u in utts[rank::world]:
        wav, _ = torchaudio.load(os.path.join(wav_dir, u))
        local[u] = F.normalize(model.embed(wav.to(device)), dim=-1)[0].cpu()
    model.train()
    shards = [None] * world
    dist.all_gather_object(shards, local)
    emb = {k: v for s in shards for k, v in s.items()}
    scores = np.array([float(emb[a] @ emb[b]) for _, a, b in trials])
    labels = np.array([int(t[0]) for t in trials], dtype=np.float64)
    return eer_from_scores(scores, labels)


def save_checkpoint(path, model, opt, sched, epoch, eer):
    tmp = path + ".tmp"
    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "epoch": epoch, "eer": eer}, tmp)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vox2_dir", default="/data/voxceleb2/dev/aac_wav")
    ap.add_argument("--musan_dir", default="/data/musan/noise")
    ap.add_argument("--trials", default="/data/voxceleb1/veri_test2.txt")
    ap.add_argument("--vox1_test", default="/data/voxceleb1/test/wav")
    ap.add_argument("--exp", default="exp/ecapa_c1024")
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--channels", type=int, default=1024)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    dataset = VoxTrainSet(args.vox2_dir, args.musan_dir)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=10,
                        pin_memory=True, drop_last=True)

    model = SpeakerModel(len(dataset.spk2id), channels=args.channels)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=2e-5)
    sched = torch.optim.lr_scheduler.CyclicLR(opt, base_lr=1e-8, max_lr=args.lr, step_size_up=65000 // world,
                                              mode="triangular2", cycle_momentum=False)

    os.makedirs(args.exp, exist_ok=True)
    last = os.path.join(args.exp, "last.pt")
    start_epoch, best_eer = 0, 1.0
    if os.path.exists(last):
        ckpt = torch.load(last, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        loss_acc = torch.zeros((), device=device)
        for i, (wav, y) in enumerate(loader):
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = model(wav, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_acc += loss.detach()
            if rank == 0 and i % 200 == 0:
                print(f"[{epoch}:{i}/{len(loader)}] loss={loss.item():.4f} lr={sched.get_last_lr()[0]:.2e}",
                      flush=True)
        dist.all_reduce(loss_acc)

        eer = voxceleb1_eer(model.module, args.trials, args.vox1_test, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch}: train loss {loss_acc.item() / (world * len(loader)):.4f} "
                  f"Vox1-O EER {100 * eer:.3f}%", flush=True)
        save_checkpoint(last, model, opt, sched, epoch, eer)
        if eer < best_eer:
            best_eer = eer
            shutil.copyfile(last, os.path.join(args.exp, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
