"""BC-ResNet wake-word / command model trained from a CSV manifest.

The in-house manifest is heavily skewed (a few thousand "hey_nova" clips,
hundreds of thousands of negatives), so training batches are drawn with a
class-balanced sampler.

Launch:
    torchrun --standalone --nproc_per_node=8 02_bcresnet_balanced_wakeword.py --config conf/bcres_nova.yaml
"""
import argparse
import csv
import math
import os
import random
from dataclasses import dataclass, field
from typing import List

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, WeightedRandomSampler
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


@dataclass
class Config:
    train_manifest: str = "manifests/train.csv"
    valid_manifest: str = "manifests/valid.csv"
    noise_manifest: str = "manifests/noise.csv"
    classes: List[str] = field(default_factory=lambda: ["negative", "hey_nova", "stop", "volume_up", "volume_down"])
    clip_seconds: float = 1.5
    sample_rate: int = 16000
    width: int = 2  # BC-ResNet-2
    batch_size: int = 256
    epochs: int = 40
    lr: float = 1e-3
    warmup_epochs: int = 2
    snr_low: float = 0.0
    snr_high: float = 20.0
    num_workers: int = 8
    seed: int = 17
    out_dir: str = "exp/bcres_nova"


def load_config(path):
    cfg = Config()
    if path:
        with open(path) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, v)
    return cfg


def read_manifest(path):
    with open(path) as f:
        return [(row["path"], row["label"]) for row in csv.DictReader(f)]


class ManifestDataset(Dataset):
    def __init__(self, cfg, manifest, train):
        self.cfg = cfg
        self.items = [(p, cfg.classes.index(lab)) for p, lab in read_manifest(manifest)]
        self.noises = [p for p, _ in read_manifest(cfg.noise_manifest)] if train else []
        self.num_samples = int(cfg.clip_seconds * cfg.sample_rate)
        self.train = train

    def __len__(self):
        return len(self.items)

    @property
    def targets(self):
        return torch.tensor([y for _, y in self.items])

    def _load(self, path):
        wav, sr = torchaudio.load(path)
        if sr != self.cfg.sample_rate:
            wav = torchaudio.functional.resample(wav, sr, self.cfg.sample_rate)
        wav = wav.mean(0)
        if wav.numel() >= self.num_samples:
            off = random.randint(0, wav.numel() - self.num_samples) if self.train else 0
            return wav[off:off + self.num_samples]
        return F.pad(wav, (0, self.num_samples - wav.numel()))

    def __getitem__(self, idx):
        path, label = self.items[idx]
        wav = self._load(path)
        if self.train and self.noises and random.random() < 0.7:
            noise = self._load(random.choice(self.noises))
            snr = random.uniform(self.cfg.snr_low, self.cfg.snr_high)
            p_sig = wav.pow(2).mean().clamp_min(1e-8)
            p_noise = noise.pow(2).mean().clamp_min(1e-8)
            wav = wav + noise * torch.sqrt(p_sig / (p_noise * 10 ** (snr / 10)))
        return wav, label


def make_balanced_sampler(targets, num_classes):
    counts = torch.bincount(targets, minlength=num_classes).float()
    weights = (1.0 / counts.clamp_min(1))[targets]
    return WeightedRandomSampler(weights.double(), num_samples=len(targets), replacement=True)


class SubSpectralNorm(nn.Module):
    def __init__(self, ch, sub_bands=5):
        super().__init__()
        self.s = sub_bands
        self.bn = nn.BatchNorm2d(ch * sub_bands)

    def forward(self, x):
        b, c, f, t = x.shape
        x = self.bn(x.view(b, c * self.s, f // self.s, t))
        return x.view(b, c, f, t)


class BCBlock(nn.Module):
    def __init__(self, cin, cout, stride=1, dilation=1):
        super().__init__()
        self.transition = cin != cout
        if self.transition:
            self.proj = nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())
        self.f2 = nn.Sequential(
            nn.Conv2d(cout, cout, (3, 1), stride=(stride, 1), padding=(1, 0), groups=cout, bias=False),
            SubSpectralNorm(cout))
        self.f1 = nn.Sequential(
            nn.Conv2d(cout, cout, (1, 3), padding=(0, dilation), dilation=(1, dilation), groups=cout, bias=False),
            nn.BatchNorm2d(cout), nn.SiLU(), nn.Conv2d(cout, cout, 1, bias=False), nn.Dropout2d(0.1))

    def forward(self, x):
        if self.transition:
            x = self.proj(x)
        x2 = self.f2(x)
        x1 = self.f1(x2.mean(2, keepdim=True))
        out = x1 + x2
        if not self.transition:
            out = out + x
        return F.relu(out)


class BCResNet(nn.Module):
    def __init__(self, n_classes, w=1):
        super().__init__()
        c = [int(8 * w * m) for m in (2, 1, 1.5, 2, 2.5, 4)]
        self.stem = nn.Conv2d(1, c[0], 5, stride=(2, 1), padding=2)
        layers, cin = [], c[0]
        for i, (n, s, d) in enumerate([(2, 1, 1), (2, 2, 2), (4, 2, 4), (4, 1, 8)]):
            for j in range(n):
                layers.append(BCBlock(cin, c[i + 1], stride=s if j == 0 else 1, dilation=d))
                cin = c[i + 1]
        self.blocks = nn.Sequential(*layers)
        self.head = nn.Sequential(
            nn.Conv2d(cin, cin, (5, 5), groups=cin, padding=(0, 2)),
            nn.Conv2d(cin, c[5], 1), nn.BatchNorm2d(c[5]), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Conv2d(c[5], n_classes, 1))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x))).flatten(1)


class Frontend(nn.Module):
    def __init__(self, sr):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(sr, n_fft=512, win_length=480, hop_length=160, n_mels=40)
        self.specaug = nn.Sequential(torchaudio.transforms.FrequencyMasking(8),
                                     torchaudio.transforms.TimeMasking(20))

    def forward(self, wav, augment=False):
        x = (self.mel(wav) + 1e-6).log().unsqueeze(1)
        return self.specaug(x) if augment else x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="")
    cfg = load_config(ap.parse_args().config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed)

    train_set = ManifestDataset(cfg, cfg.train_manifest, train=True)
    valid_set = ManifestDataset(cfg, cfg.valid_manifest, train=False)
    sampler = make_balanced_sampler(train_set.targets, len(cfg.classes))
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler,
                              num_workers=cfg.num_workers, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_set, batch_size=512, sampler=DistributedSampler(valid_set, shuffle=False),
                              num_workers=cfg.num_workers, pin_memory=True)

    frontend = Frontend(cfg.sample_rate).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(BCResNet(len(cfg.classes), cfg.width)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-3)
    steps_per_epoch = len(train_loader)
    total, warm = cfg.epochs * steps_per_epoch, cfg.warmup_epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    writer = SummaryWriter(cfg.out_dir) if rank == 0 else None
    os.makedirs(cfg.out_dir, exist_ok=True)
    step, best = 0, 0.0
    for epoch in range(cfg.epochs):
        model.train()
        for wav, y in train_loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.no_grad():
                x = frontend(wav, augment=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            step += 1
            if writer and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)

        model.eval()
        n_cls = len(cfg.classes)
        confusion = torch.zeros(n_cls, n_cls, device=device)
        with torch.no_grad():
            for wav, y in valid_loader:
                wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
                pred = model(frontend(wav)).argmax(1)
                confusion.index_put_((y, pred), torch.ones_like(y, dtype=torch.float), accumulate=True)
        dist.all_reduce(confusion)
        recall = confusion.diag() / confusion.sum(1).clamp_min(1)
        bal_acc = recall.mean().item()

        if rank == 0:
            writer.add_scalar("valid/balanced_acc", bal_acc, epoch)
            for i, name in enumerate(cfg.classes):
                writer.add_scalar(f"valid/recall_{name}", recall[i].item(), epoch)
            print(f"epoch {epoch}: balanced acc {bal_acc:.4f} recall {[round(r, 3) for r in recall.tolist()]}")
            ckpt = {"model": model.module.state_dict(), "cfg": vars(cfg), "epoch": epoch}
            torch.save(ckpt, os.path.join(cfg.out_dir, "last.pt"))
            if bal_acc > best:
                best = bal_acc
                torch.save(ckpt, os.path.join(cfg.out_dir, "best.pt"))

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
