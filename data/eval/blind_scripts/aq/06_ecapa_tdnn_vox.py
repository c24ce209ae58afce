#!/usr/bin/env python3
"""ECAPA-TDNN (C=512) + AAM-softmax, VoxCeleb2 dev -> Vox1-O / Vox1-E.

torchrun --nnodes=1 --nproc_per_node=4 06_ecapa_tdnn_vox.py --config conf/ecapa512.yaml
"""
import argparse
import math
import os
import random

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class TrainSet(Dataset):
    def __init__(self, list_file, root, num_frames=200):
        with open(list_file) as f:
            rows = [l.split() for l in f if l.strip()]
        spks = sorted(set(r[0] for r in rows))
        self.spk2idx = {s: i for i, s in enumerate(spks)}
        self.data = [(self.spk2idx[s], os.path.join(root, p)) for s, p in rows]
        self.seg = num_frames * 160 + 240

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        lab, path = self.data[i]
        audio, _ = sf.read(path, dtype="float32")
        if audio.shape[0] <= self.seg:
            audio = np.pad(audio, (0, self.seg - audio.shape[0]), "wrap")
        st = np.random.randint(0, audio.shape[0] - self.seg + 1)
        return torch.from_numpy(audio[st:st + self.seg].copy()), lab


class EvalSet(Dataset):
    def __init__(self, files, root):
        self.files, self.root = files, root

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        audio, _ = sf.read(os.path.join(self.root, self.files[i]), dtype="float32")
        return torch.from_numpy(audio), i


class SEModule(nn.Module):
    def __init__(self, ch, bottleneck=128):
        super().__init__()
        self.se = nn.Sequential(nn.AdaptiveAvgPool1d(1), nn.Conv1d(ch, bottleneck, 1), nn.ReLU(),
                                nn.Conv1d(bottleneck, ch, 1), nn.Sigmoid())

    def forward(self, x):
        return x * self.se(x)


class Res2Block(nn.Module):
    def __init__(self, ch, k, d, scale=8):
        super().__init__()
        w = ch // scale
        self.conv1 = nn.Sequential(nn.Conv1d(ch, w * scale, 1), nn.ReLU(), nn.BatchNorm1d(w * scale))
        self.convs = nn.ModuleList([nn.Sequential(nn.Conv1d(w, w, k, dilation=d, padding=d * (k // 2)),
                                                  nn.ReLU(), nn.BatchNorm1d(w)) for _ in range(scale - 1)])
        self.conv3 = nn.Sequential(nn.Conv1d(w * scale, ch, 1), nn.ReLU(), nn.BatchNorm1d(ch))
        self.se = SEModule(ch)
        self.width = w

    def forward(self, x):
        out = self.conv1(x)
        spx = torch.split(out, self.width, 1)
        outs, sp = [], None
        for i, conv in enumerate(self.convs):
            sp = spx[i] if i == 0 else sp + spx[i]
            sp = conv(sp)
            outs.append(sp)
        outs.append(spx[-1])
        return self.se(self.conv3(torch.cat(outs, 1))) + x


class ECAPA(nn.Module):
    def __init__(self, C=512, emb=192, n_mels=80):
        super().__init__()
        self.fbank = torchaudio.transforms.MelSpectrogram(16000, n_fft=512, win_length=400, hop_length=160,
                                                          f_min=20, f_max=7600, n_mels=n_mels,
                                                          window_fn=torch.hamming_window)
        self.specaug = nn.Sequential(torchaudio.transforms.FrequencyMasking(8), torchaudio.transforms.TimeMasking(10))
        self.conv1 = nn.Sequential(nn.Conv1d(n_mels, C, 5, padding=2), nn.ReLU(), nn.BatchNorm1d(C))
        self.layer1, self.layer2, self.layer3 = Res2Block(C, 3, 2), Res2Block(C, 3, 3), Res2Block(C, 3, 4)
        self.layer4 = nn.Conv1d(3 * C, 1536, 1)
        self.attention = nn.Sequential(nn.Conv1d(4608, 256, 1), nn.ReLU(), nn.BatchNorm1d(256), nn.Tanh(),
                                       nn.Conv1d(256, 1536, 1), nn.Softmax(dim=2))
        self.bn5 = nn.BatchNorm1d(3072)
        self.fc6 = nn.Linear(3072, emb)
        self.bn6 = nn.BatchNorm1d(emb)

    def forward(self, x, aug=False):
        with torch.no_grad():
            x = (self.fbank(x) + 1e-6).log()
            x = x - x.mean(dim=-1, keepdim=True)
            if aug:
                x = self.specaug(x)
        x = self.conv1(x)
        x1 = self.layer1(x)
        x2 = self.layer2(x + x1)
        x3 = self.layer3(x + x1 + x2)
        x = F.relu(self.layer4(torch.cat((x1, x2, x3), 1)))
        t = x.size(-1)
        gx = torch.cat((x, x.mean(2, keepdim=True).repeat(1, 1, t),
                        x.var(2, keepdim=True).clamp(min=1e-4).sqrt().repeat(1, 1, t)), 1)
        w = self.attention(gx)
        mu = (x * w).sum(2)
        sg = ((x ** 2) * w).sum(2).sub(mu ** 2).clamp(min=1e-4).sqrt()
        return self.bn6(self.fc6(self.bn5(torch.cat((mu, sg), 1))))


class AAMHead(nn.Module):
    def __init__(self, emb, n_class, margin=0.2, scale=30):
        super().__init__()
        self.W = nn.Parameter(torch.randn(n_class, emb) * 0.01)
        self.scale = scale
        self.set_margin(margin)

    def set_margin(self, m):
        self.m = m
        self.cos_m, self.sin_m = math.cos(m), math.sin(m)
        self.th, self.mm = math.cos(math.pi - m), math.sin(math.pi - m) * m

    def forward(self, x, y):
        cos = F.linear(F.normalize(x), F.normalize(self.W))
        sin = (1 - cos * cos).clamp(1e-7, 1).sqrt()
        phi = cos * self.cos_m - sin * self.sin_m
        phi = torch.where(cos > self.th, phi, cos - self.mm)
        logits = torch.where(F.one_hot(y, cos.size(1)).bool(), phi, cos) * self.scale
        return F.cross_entropy(logits, y), (cos.argmax(1) == y).float().mean()


class Model(nn.Module):
    def __init__(self, n_spk, cfg):
        super().__init__()
        self.encoder = ECAPA(cfg["channels"], cfg["emb_dim"])
        self.head = AAMHead(cfg["emb_dim"], n_spk, cfg["margin"], cfg["scale"])

    def forward(self, wav, y):
        return self.head(self.encoder(wav, aug=True), y)


def all_gather_varlen(t, world_size):
    """all_gather for tensors whose first dim differs between ranks."""
    n = torch.tensor([t.size(0)], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world_size)]
    dist.all_gather(sizes, n)
    max_n = int(max(s.item() for s in sizes))
    padded = t.new_zeros((max_n,) + tuple(t.shape[1:]))
    padded[: t.size(0)] = t
    out = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(out, padded)
    return [o[: int(s.item())] for o, s in zip(out, sizes)]


@torch.no_grad()
def eval_eer(encoder, trials, root, device, rank, world_size):
    encoder.eval()
    files = sorted({t[1] for t in trials} | {t[2] for t in trials})
    my_idx = list(range(rank, len(files), world_size))
    loader = DataLoader(torch.utils.data.Subset(EvalSet(files, root), my_idx), batch_size=1, num_workers=4)
    idx_list, emb_list = [], []
    for wav, i in loader:
        emb_list.append(F.normalize(encoder(wav.to(device)), dim=1))
        idx_list.append(i.to(device))
    idx = torch.cat(idx_list)
    emb = torch.cat(emb_list)
    all_idx = torch.cat(all_gather_varlen(idx, world_size)).cpu()
    all_emb = torch.cat(all_gather_varlen(emb, world_size)).cpu()
    table = torch.empty(len(files), all_emb.size(1))
    table[all_idx] = all_emb
    f2i = {f: i for i, f in enumerate(files)}
    scores = np.array([float(table[f2i[a]] @ table[f2i[b]]) for _, a, b in trials])
    labels = np.array([int(l) for l, _, _ in trials])
    encoder.train()
    order = np.argsort(-scores)
    labels = labels[order]
    tp = np.cumsum(labels); fp = np.cumsum(1 - labels)
    fnr = 1 - tp / labels.sum(); fpr = fp / (1 - labels).sum()
    i = np.argmin(np.abs(fnr - fpr))
    return 100 * (fnr[i] + fpr[i]) / 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 42))
    np.random.seed(cfg.get("seed", 42) + rank)
    random.seed(cfg.get("seed", 42) + rank)

    train_set = TrainSet(cfg["train_list"], cfg["wav_root"], cfg["num_frames"])
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    per_gpu_bs = cfg["global_batch_size"] // world_size
    loader = DataLoader(train_set, per_gpu_bs, sampler=sampler, num_workers=cfg["workers"], pin_memory=True,
                        drop_last=True, worker_init_fn=lambda w: np.random.seed((torch.initial_seed() + w) % 2 ** 32))
    with open(cfg["trials"]) as f:
        trials = [l.split() for l in f if l.strip()]

    model = nn.SyncBatchNorm.convert_sync_batchnorm(Model(len(train_set.spk2idx), cfg)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"], weight_decay=2e-5)
    start_epoch, best = 1, 100.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best_eer"]
    model = DDP(model, device_ids=[local_rank])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=cfg["lr_decay"],
                                                last_epoch=start_epoch - 2)

    os.makedirs(cfg["exp_dir"], exist_ok=True)
    for epoch in range(start_epoch, cfg["epochs"] + 1):
        sampler.set_epoch(epoch)
        ramp = min(1.0, max(0.0, (epoch - cfg["margin_warm_start"]) / cfg["margin_warm_epochs"]))
        model.module.head.set_margin(cfg["margin"] * ramp)
        meter = torch.zeros(3, device=device)
        for wav, y in loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss, acc = model(wav, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            meter += torch.stack([loss.detach() * y.size(0), acc.detach() * y.size(0),
                                  torch.tensor(float(y.size(0)), device=device)])
        scheduler.step()
        dist.all_reduce(meter)
        if rank == 0:
            print(f"[{epoch:03d}] loss {meter[0] / meter[2]:.3f} acc {100 * meter[1] / meter[2]:.2f} "
                  f"margin {model.module.head.m:.3f} lr {optimizer.param_groups[0]['lr']:.2e}", flush=True)
        if epoch % cfg["eval_interval"] == 0:
            eer = eval_eer(model.module.encoder, trials, cfg["wav_root"], device, rank, world_size)
            if rank == 0:
                print(f"[{epoch:03d}] EER {eer:.3f}%", flush=True)
                best = min(best, eer)
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch, "best_eer": best}, os.path.join(cfg["exp_dir"], f"epoch{epoch}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
