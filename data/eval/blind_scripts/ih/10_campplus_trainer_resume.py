"""CAM++ speaker embedding training (3D-Speaker model definition), resumable.

    torchrun --nproc_per_node=8 10_campplus_trainer_resume.py --config conf/campplus.yaml
    # after a preemption:
    torchrun --nproc_per_node=8 10_campplus_trainer_resume.py --config conf/campplus.yaml \
        --resume exp/campplus/ckpt_latest.pt
"""
import argparse
import logging
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import torchaudio.compliance.kaldi as Kaldi
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from speakerlab.models.campplus.DTDNN import CAMPPlus

log = logging.getLogger("campplus")


class ArcFaceHead(nn.Module):
    def __init__(self, in_dim, n_cls, scale=32.0, margin=0.2):
        super().__init__()
        self.weight = nn.Parameter(torch.FloatTensor(n_cls, in_dim))
        nn.init.xavier_uniform_(self.weight)
        self.scale = scale
        self.update(margin)

    def update(self, margin):
        self.margin = margin
        self.cos_m, self.sin_m = math.cos(margin), math.sin(margin)
        self.th = math.cos(math.pi - margin)
        self.mm = math.sin(math.pi - margin) * margin

    def forward(self, emb, label):
        cosine = F.linear(F.normalize(emb), F.normalize(self.weight))
        sine = torch.sqrt((1.0 - cosine.pow(2)).clamp(0, 1))
        phi = cosine * self.cos_m - sine * self.sin_m
        phi = torch.where(cosine > self.th, phi, cosine - self.mm)
        onehot = torch.zeros_like(cosine).scatter_(1, label.view(-1, 1), 1)
        logits = self.scale * (onehot * phi + (1 - onehot) * cosine)
        return F.cross_entropy(logits, label), (cosine.argmax(1) == label).float().mean()


class SpeakerModel(nn.Module):
    def __init__(self, n_spk, emb_dim=192):
        super().__init__()
        self.embedding_model = CAMPPlus(feat_dim=80, embedding_size=emb_dim)
        self.head = ArcFaceHead(emb_dim, n_spk)

    def forward(self, feats, label):
        return self.head(self.embedding_model(feats), label)


def kaldi_fbank(wav, dither):
    x = Kaldi.fbank(wav.unsqueeze(0), num_mel_bins=80, sample_frequency=16000, dither=dither)
    return x - x.mean(0, keepdim=True)


class WavScpDataset(Dataset):
    def __init__(self, wav_scp, utt2spk, seconds):
        u2w = dict(l.split(maxsplit=1) for l in open(wav_scp).read().splitlines())
        u2s = dict(l.split() for l in open(utt2spk).read().splitlines())
        self.spk2label = {s: i for i, s in enumerate(sorted(set(u2s.values())))}
        self.data = [(u2w[u], self.spk2label[u2s[u]]) for u in sorted(u2w)]
        self.len = int(seconds * 16000)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        path, label = self.data[i]
        wav, sr = torchaudio.load(path)
        wav = wav[0]
        if wav.shape[0] < self.len:
            wav = F.pad(wav, (0, self.len - wav.shape[0]), mode="constant")
        start = random.randint(0, wav.shape[0] - self.len)
        return kaldi_fbank(wav[start:start + self.len], dither=1.0), label


class Trainer:
    def __init__(self, cfg, args):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.exp = cfg["exp_dir"]

        self.train_set = WavScpDataset(cfg["wav_scp"], cfg["utt2spk"], cfg["seconds"])
        self.sampler = DistributedSampler(self.train_set, shuffle=True, drop_last=True)
        self.loader = DataLoader(self.train_set, batch_size=cfg["batch_size"] // self.world,
                                 sampler=self.sampler, num_workers=cfg["num_workers"],
                                 pin_memory=True, drop_last=True)

        model = SpeakerModel(len(self.train_set.spk2label), cfg["emb_dim"]).to(self.device)
        self.model = DDP(model, device_ids=[self.local_rank])
        self.opt = torch.optim.SGD(self.model.parameters(), lr=cfg["lr"], momentum=0.9,
                                   nesterov=True, weight_decay=cfg["weight_decay"])
        self.epoch = 0
        self.best_eer = float("inf")
        if args.resume:
            self.load(args.resume)

    # ------------------------------------------------------------------ checkpoints
    def save(self, name):
        if self.rank != 0:
            return
        torch.save({"model": self.model.module.state_dict(), "optimizer": self.opt.state_dict(),
                    "epoch": self.epoch, "best_eer": self.best_eer},
                   os.path.join(self.exp, name))

    def load(self, path):
        checkpoint = torch.load(path)
        self.model.module.load_state_dict(checkpoint["model"])
        self.opt.load_state_dict(checkpoint["optimizer"])
        self.epoch = checkpoint["epoch"] + 1
        self.best_eer = checkpoint["best_eer"]
        log.info("resumed from %s at epoch %d", path, self.epoch)

    # ------------------------------------------------------------------ schedule
    def lr_for(self, epoch_float):
        warm, total, base = self.cfg["warmup_epochs"], self.cfg["epochs"], self.cfg["lr"]
        if epoch_float < warm:
            return base * epoch_float / warm
        return 0.5 * base * (1 + math.cos(math.pi * (epoch_float - warm) / (total - warm)))

    def margin_for(self, epoch):
        lo, hi = self.cfg["margin_increase_start"], self.cfg["margin_increase_end"]
        return self.cfg["margin"] * min(1.0, max(0.0, (epoch - lo) / max(1, hi - lo)))

    # ------------------------------------------------------------------ loops
    def train_epoch(self):
        self.model.train()
        self.sampler.set_epoch(self.epoch)
        self.model.module.head.update(self.margin_for(self.epoch))
        n = len(self.loader)
        sums = torch.zeros(2, device=self.device)
        tic = time.time()
        for i, (feats, label) in enumerate(self.loader):
            for g in self.opt.param_groups:
                g["lr"] = self.lr_for(self.epoch + i / n)
            feats = feats.to(self.device, non_blocking=True)
            label = label.to(self.device, non_blocking=True)
            loss, acc = self.model(feats, label)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            sums += torch.stack([loss.detach(), acc.detach()])
        dist.all_reduce(sums)
        sums /= n * self.world
        log.info("epoch %d loss %.4f acc %.2f%% margin %.3f %.0fs", self.epoch, sums[0], 100 * sums[1],
                 self.model.module.head.margin, time.time() - tic)

    @torch.no_grad()
    def validate(self):
        emb_model = self.model.module.embedding_model
        emb_model.eval()
        trials = [l.split() for l in open(self.cfg["trials"])]
        utts = sorted({u for t in trials for u in t[:2]})
        mine = {}
        for u in utts[self.rank::self.world]:
            wav, _ = torchaudio.load(os.path.join(self.cfg["eval_root"], u))
            x = kaldi_fbank(wav[0], dither=0.0).unsqueeze(0).to(self.device)
            mine[u] = F.normalize(emb_model(x), dim=-1)[0].cpu()
        allparts = [None] * self.world
        dist.all_gather_object(allparts, mine)
        emb = {}
        for part in allparts:
            emb.update(part)
        scores = np.array([float(emb[a] @ emb[b]) for a, b, _ in trials])
        labels = np.array([t[2] == "target" for t in trials], dtype=int)
        thr = np.sort(scores)
        fnr = np.searchsorted(np.sort(scores[labels == 1]), thr) / labels.sum()
        fpr = 1 - np.searchsorted(np.sort(scores[labels == 0]), thr) / (1 - labels).sum()
        i = np.argmin(np.abs(fnr - fpr))
        return 100 * (fnr[i] + fpr[i]) / 2

    def fit(self):
        if self.rank == 0:
            os.makedirs(self.exp, exist_ok=True)
        while self.epoch < self.cfg["epochs"]:
            self.train_epoch()
            eer = self.validate()
            log.info("epoch %d Vox1-O EER %.3f%%", self.epoch, eer)
            if eer < self.best_eer:
                self.best_eer = eer
                self.save("ckpt_best.pt")
            self.save("ckpt_latest.pt")
            dist.barrier()
            self.epoch += 1
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    logging.basicConfig(level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    Trainer(cfg, args).fit()


if __name__ == "__main__":
    main()
