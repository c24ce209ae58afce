"""ESC-50 environmental sound classification, log-mel + EfficientNet-B0 (timm), DDP.

Fold 5 held out as in the official protocol.
    torchrun --nnodes=1 --nproc_per_node=4 14_esc50_melspec_cnn_ddp.py --config esc50.yaml
"""
import argparse
import os
import random

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

DEFAULTS = dict(root="data/ESC-50-master", sr=32000, n_mels=128, hop=320, n_fft=1024,
                clip_sec=5.0, epochs=60, batch_size=32, lr=1e-3, mixup_alpha=0.4,
                model="efficientnet_b0", val_fold=5, log_dir="tb/esc50", ckpt="ckpt/esc50_b0.pt")


class ESC50(Dataset):
    def __init__(self, meta, root, sr, clip_sec, train):
        self.meta = meta.reset_index(drop=True)
        self.root, self.sr, self.train = root, sr, train
        self.n = int(sr * clip_sec)
        self._resamplers = {}

    def __len__(self):
        return len(self.meta)

    def _load(self, fname):
        wav, sr = torchaudio.load(os.path.join(self.root, "audio", fname))
        if sr != self.sr:
            if sr not in self._resamplers:
                self._resamplers[sr] = torchaudio.transforms.Resample(sr, self.sr)
            wav = self._resamplers[sr](wav)
        wav = wav.mean(0)
        if wav.numel() < self.n:
            wav = torch.nn.functional.pad(wav, (0, self.n - wav.numel()))
        return wav[: self.n]

    def __getitem__(self, i):
        row = self.meta.iloc[i]
        wav = self._load(row.filename)
        if self.train:
            wav = torch.roll(wav, random.randint(0, self.n - 1))
            wav = wav * (10 ** (random.uniform(-6, 6) / 20))
        return wav, int(row.target)


class MelFrontend(nn.Module):
    def __init__(self, sr, n_fft, hop, n_mels):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(sr, n_fft=n_fft, hop_length=hop, n_mels=n_mels,
                                                        f_min=20, f_max=sr // 2)
        self.db = torchaudio.transforms.AmplitudeToDB(top_db=80)
        self.spec_aug = nn.Sequential(torchaudio.transforms.FrequencyMasking(24),
                                      torchaudio.transforms.TimeMasking(64))

    def forward(self, wav):
        x = self.db(self.mel(wav)).unsqueeze(1)
        x = (x + 40.0) / 40.0
        if self.training:
            x = self.spec_aug(x)
        return x


class SoundNet(nn.Module):
    def __init__(self, cfg, n_classes=50):
        super().__init__()
        self.front = MelFrontend(cfg["sr"], cfg["n_fft"], cfg["hop"], cfg["n_mels"])
        self.cnn = timm.create_model(cfg["model"], pretrained=False, in_chans=1, num_classes=n_classes)

    def forward(self, wav):
        return self.cnn(self.front(wav))


def mixup(x, y, alpha, n_classes=50):
    y = torch.nn.functional.one_hot(y, n_classes).float()
    lam = np.random.beta(alpha, alpha)
    perm = torch.randperm(x.size(0), device=x.device)
    return lam * x + (1 - lam) * x[perm], lam * y + (1 - lam) * y[perm]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    ce = nn.CrossEntropyLoss(reduction="sum")
    for wav, y in loader:
        wav, y = wav.to(device), y.to(device)
        logits = model(wav)
        loss_sum += ce(logits, y).item()
        correct += (logits.argmax(1) == y).sum().item()
        total += y.numel()
    stats = torch.tensor([correct, total, loss_sum], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return stats[0].item() / stats[1].item(), stats[2].item() / stats[1].item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    args = ap.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed = 1234 + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(1234)

    meta = pd.read_csv(os.path.join(cfg["root"], "meta", "esc50.csv"))
    tr = ESC50(meta[meta.fold != cfg["val_fold"]], cfg["root"], cfg["sr"], cfg["clip_sec"], train=True)
    va = ESC50(meta[meta.fold == cfg["val_fold"]], cfg["root"], cfg["sr"], cfg["clip_sec"], train=False)
    sampler = DistributedSampler(tr, shuffle=True, drop_last=True)
    tr_dl = DataLoader(tr, batch_size=cfg["batch_size"], sampler=sampler, num_workers=6,
                       pin_memory=True, drop_last=True)
    va_dl = DataLoader(Subset(va, range(rank, len(va), world)), batch_size=64, num_workers=4)

    model = SoundNet(cfg).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"], epochs=cfg["epochs"],
                                                steps_per_epoch=len(tr_dl), pct_start=0.1)
    criterion = nn.BCEWithLogitsLoss()
    writer = SummaryWriter(cfg["log_dir"]) if rank == 0 else None

    best = 0.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        for wav, y in tr_dl:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            wav, y_soft = mixup(wav, y, cfg["mixup_alpha"])
            loss = criterion(model(wav), y_soft)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()

        acc, val_loss = evaluate(model.module, va_dl, device)
        if rank == 0:
            writer.add_scalar("val/acc", acc, epoch)
            writer.add_scalar("val/loss", val_loss, epoch)
            writer.add_scalar("train/last_loss", loss.item(), epoch)
            print(f"epoch {epoch:03d} val acc {acc:.4f} loss {val_loss:.4f}", flush=True)
            if acc > best:
                best = acc
                os.makedirs(os.path.dirname(cfg["ckpt"]), exist_ok=True)
                torch.save({"model": model.module.state_dict(), "cfg": cfg, "epoch": epoch, "acc": acc},
                           cfg["ckpt"])

    if rank == 0:
        writer.close()
        print(f"best val acc {best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
