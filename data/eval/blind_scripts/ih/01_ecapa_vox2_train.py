#!/usr/bin/env python3
"""Train ECAPA-TDNN (C=1024) on VoxCeleb2-dev with AAM-softmax.

One process per GPU, launched with torchrun. Every `eval_every` epochs the
embeddings of VoxCeleb1 test utterances are extracted (sharded over ranks)
and EER / minDCF are reported on VoxCeleb1-O (cleaned).
"""
import argparse
import math
import os
import random
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import yaml
from sklearn.metrics import roc_curve
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SR = 16000

DEFAULTS = dict(
    train_list="data/vox2_dev/train.list",
    spk2id="data/vox2_dev/spk2id",
    trials="data/vox1/veri_test2.txt",
    eval_root="data/vox1/wav",
    exp_dir="exp/ecapa_c1024",
    channels=1024, emb_dim=192, n_mels=80,
    seg_sec=2.0, global_batch=512,
    lr=2e-3, min_lr=1e-5, weight_decay=2e-5, epochs=80, warmup_epochs=2,
    margin=0.2, scale=30.0,
    num_workers=8, eval_every=5, log_every=100, seed=42,
)


# ---------------------------------------------------------------- model
class SEBlock(nn.Module):
    def __init__(self, ch, bottleneck=128):
        super().__init__()
        self.net = nn.Sequential(
            nn.AdaptiveAvgPool1d(1), nn.Conv1d(ch, bottleneck, 1), nn.ReLU(inplace=True),
            nn.Conv1d(bottleneck, ch, 1), nn.Sigmoid())

    def forward(self, x):
        return x * self.net(x)


class Res2Block(nn.Module):
    def __init__(self, ch, k, dilation, scale=8):
        super().__init__()
        self.scale, self.width = scale, ch // scale
        self.conv1 = nn.Conv1d(ch, ch, 1)
        self.bn1 = nn.BatchNorm1d(ch)
        pad = dilation * (k // 2)
        self.convs = nn.ModuleList(nn.Conv1d(self.width, self.width, k, dilation=dilation, padding=pad)
                                   for _ in range(scale - 1))
        self.bns = nn.ModuleList(nn.BatchNorm1d(self.width) for _ in range(scale - 1))
        self.conv3 = nn.Conv1d(ch, ch, 1)
        self.bn3 = nn.BatchNorm1d(ch)
        self.se = SEBlock(ch)

    def forward(self, x):
        out = self.bn1(F.relu(self.conv1(x)))
        chunks = torch.split(out, self.width, dim=1)
        ys, sp = [], None
        for i in range(self.scale - 1):
            sp = chunks[i] if i == 0 else sp + chunks[i]
            sp = self.bns[i](F.relu(self.convs[i](sp)))
            ys.append(sp)
        ys.append(chunks[-1])
        out = self.bn3(F.relu(self.conv3(torch.cat(ys, dim=1))))
        return self.se(out) + x


class AttentiveStatsPool(nn.Module):
    def __init__(self, ch, attn=128):
        super().__init__()
        self.attention = nn.Sequential(
            nn.Conv1d(ch * 3, attn, 1), nn.ReLU(), nn.BatchNorm1d(attn), nn.Tanh(),
            nn.Conv1d(attn, ch, 1), nn.Softmax(dim=2))

    def forward(self, x):
        T = x.size(-1)
        mu = x.mean(dim=2, keepdim=True).expand(-1, -1, T)
        sg = torch.sqrt(x.var(dim=2, keepdim=True).clamp(min=1e-4)).expand(-1, -1, T)
        w = self.attention(torch.cat([x, mu, sg], dim=1))
        mean = torch.sum(x * w, dim=2)
        std = torch.sqrt((torch.sum(x * x * w, dim=2) - mean ** 2).clamp(min=1e-4))
        return torch.cat([mean, std], dim=1)


class ECAPATDNN(nn.Module):
    def __init__(self, n_mels=80, C=1024, emb_dim=192):
        super().__init__()
        self.fbank = torchaudio.transforms.MelSpectrogram(
            sample_rate=SR, n_fft=512, win_length=400, hop_length=160,
            f_min=20, f_max=7600, window_fn=torch.hamming_window, n_mels=n_mels)
        self.conv1 = nn.Conv1d(n_mels, C, 5, padding=2)
        self.bn1 = nn.BatchNorm1d(C)
        self.layer1 = Res2Block(C, 3, 2)
        self.layer2 = Res2Block(C, 3, 3)
        self.layer3 = Res2Block(C, 3, 4)
        self.mfa = nn.Conv1d(3 * C, 1536, 1)
        self.pool = AttentiveStatsPool(1536)
        self.bn_pool = nn.BatchNorm1d(3072)
        self.fc = nn.Linear(3072, emb_dim)
        self.bn_emb = nn.BatchNorm1d(emb_dim)

    def forward(self, wav):
        with torch.no_grad(), torch.autocast("cuda", enabled=False):
            x = (self.fbank(wav.float()) + 1e-6).log()
            x = x - x.mean(dim=-1, keepdim=True)
        x = self.bn1(F.relu(self.conv1(x)))
        x1 = self.layer1(x)
        x2 = self.layer2(x + x1)
        x3 = self.layer3(x + x1 + x2)
        x = F.relu(self.mfa(torch.cat([x1, x2, x3], dim=1)))
        return self.bn_emb(self.fc(self.bn_pool(self.pool(x))))


class AAMSoftmax(nn.Module):
    def __init__(self, emb_dim, n_class, m=0.2, s=30.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_class, emb_dim))
        nn.init.xavier_normal_(self.weight, gain=1)
        self.s, self.cos_m, self.sin_m = s, math.cos(m), math.sin(m)
        self.th, self.mm = math.cos(math.pi - m), math.sin(math.pi - m) * m

    def forward(self, x, label):
        cosine = F.linear(F.normalize(x), F.normalize(self.weight))
        sine = torch.sqrt((1.0 - cosine * cosine).clamp(0, 1))
        phi = cosine * self.cos_m - sine * self.sin_m
        phi = torch.where(cosine - self.th > 0, phi, cosine - self.mm)
        one_hot = torch.zeros_like(cosine).scatter_(1, label.view(-1, 1), 1.0)
        logits = self.s * (one_hot * phi + (1.0 - one_hot) * cosine)
        return F.cross_entropy(logits, label), (logits.argmax(1) == label).float().mean()


class SpeakerNet(nn.Module):
    def __init__(self, cfg, n_spk):
        super().__init__()
        self.encoder = ECAPATDNN(cfg["n_mels"], cfg["channels"], cfg["emb_dim"])
        self.head = AAMSoftmax(cfg["emb_dim"], n_spk, cfg["margin"], cfg["scale"])

    def forward(self, wav, label):
        return self.head(self.encoder(wav), label)


# ---------------------------------------------------------------- data
class VoxTrain(Dataset):
    def __init__(self, list_file, spk2id, seg_sec):
        self.items = []
        with open(list_file) as f:
            for line in f:
                path, spk = line.split()
                self.items.append((path, spk2id[spk]))
        self.n = int(seg_sec * SR) + 240

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        path, label = self.items[idx]
        wav, _ = sf.read(path, dtype="float32")
        if len(wav) <= self.n:
            wav = np.pad(wav, (0, self.n - len(wav) + 1), mode="wrap")
        start = random.randint(0, len(wav) - self.n)
        return torch.from_numpy(wav[start:start + self.n].copy()), label


def load_spk2id(path):
    with open(path) as f:
        return {spk: int(i) for spk, i in (l.split() for l in f)}


# ---------------------------------------------------------------- eval
def compute_eer_mindcf(scores, labels, p_target=0.05):
    fpr, tpr, _ = roc_curve(labels, scores, pos_label=1)
    fnr = 1 - tpr
    idx = np.nanargmin(np.abs(fnr - fpr))
    eer = (fpr[idx] + fnr[idx]) / 2
    dcf = np.min(fnr * p_target + fpr * (1 - p_target)) / min(p_target, 1 - p_target)
    return eer * 100, dcf


@torch.no_grad()
def evaluate(encoder, trials, root, device, rank, world):
    encoder.eval()
    utts = sorted({u for _, a, b in trials for u in (a, b)})
    local = {}
    for utt in utts[rank::world]:
        wav, _ = sf.read(os.path.join(root, utt), dtype="float32")
        emb = encoder(torch.from_numpy(wav).unsqueeze(0).to(device))
        local[utt] = F.normalize(emb, dim=1).squeeze(0).cpu()
    parts = [None] * world
    dist.all_gather_object(parts, local)
    if rank != 0:
        return None
    embs = {}
    for p in parts:
        embs.update(p)
    scores = np.array([float(embs[a] @ embs[b]) for _, a, b in trials])
    labels = np.array([lab for lab, _, _ in trials])
    return compute_eer_mindcf(scores, labels)


def read_trials(path):
    with open(path) as f:
        return [(int(t), a, b) for t, a, b in (l.split() for l in f)]


# ---------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    random.seed(cfg["seed"] + rank)
    np.random.seed(cfg["seed"] + rank)
    torch.manual_seed(cfg["seed"])

    spk2id = load_spk2id(cfg["spk2id"])
    train_set = VoxTrain(cfg["train_list"], spk2id, cfg["seg_sec"])
    per_gpu = cfg["global_batch"] // world
    sampler = DistributedSampler(train_set, shuffle=True, seed=cfg["seed"], drop_last=True)
    loader = DataLoader(train_set, batch_size=per_gpu, sampler=sampler, num_workers=cfg["num_workers"],
                        pin_memory=True, drop_last=True, persistent_workers=True)
    trials = read_trials(cfg["trials"])

    model = SpeakerNet(cfg, len(spk2id)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])

    steps_per_epoch = len(loader)
    total = cfg["epochs"] * steps_per_epoch
    warm = cfg["warmup_epochs"] * steps_per_epoch

    def lr_at(step):
        if step < warm:
            return cfg["lr"] * (step + 1) / warm
        t = (step - warm) / max(1, total - warm)
        return cfg["min_lr"] + 0.5 * (cfg["lr"] - cfg["min_lr"]) * (1 + math.cos(math.pi * t))

    start_epoch, best_eer = 0, float("inf")
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start_epoch, best_eer = ckpt["epoch"] + 1, ckpt["best_eer"]
    if rank == 0:
        os.makedirs(cfg["exp_dir"], exist_ok=True)
        print(f"world={world} per_gpu_batch={per_gpu} speakers={len(spk2id)} steps/epoch={steps_per_epoch}")

    scaler = torch.cuda.amp.GradScaler()
    for epoch in range(start_epoch, cfg["epochs"]):
        model.train()
        t0 = time.time()
        for it, (wav, label) in enumerate(loader):
            step = epoch * steps_per_epoch + it
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            wav = wav.to(device, non_blocking=True)
            label = label.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss, acc = model(wav, label)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

            if it % cfg["log_every"] == 0:
                stats = torch.stack([loss.detach().float(), acc.detach().float()])
                dist.all_reduce(stats)
                stats /= world
                if rank == 0:
                    print(f"ep {epoch} it {it}/{steps_per_epoch} loss {stats[0]:.3f} acc {stats[1]*100:.1f}% "
                          f"lr {lr_at(step):.2e} {time.time()-t0:.0f}s", flush=True)

        if (epoch + 1) % cfg["eval_every"] == 0 or epoch + 1 == cfg["epochs"]:
            res = evaluate(model.module.encoder, trials, cfg["eval_root"], device, rank, world)
            if rank == 0:
                eer, dcf = res
                print(f"== epoch {epoch} Vox1-O EER {eer:.3f}% minDCF(0.05) {dcf:.4f}", flush=True)
                if eer < best_eer:
                    best_eer = eer
                    torch.save(model.module.encoder.state_dict(), os.path.join(cfg["exp_dir"], "best_encoder.pt"))
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch, "best_eer": best_eer},
                       os.path.join(cfg["exp_dir"], "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
