"""Self-supervised audio-visual synchronisation pre-training (SyncNet-style, multi-way).

For each 5-frame mouth clip the network has to pick the matching 0.2 s audio window
among 31 candidate offsets (-15..+15 video frames) taken from the same utterance.
The visual stream is later reused as a lip-reading frontend.

    torchrun --nproc_per_node=8 10_av_sync_pretrain.py --config configs/sync_voxceleb2.json
"""
import argparse
import json
import logging
import os
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

logger = logging.getLogger("avsync")


@dataclass
class Config:
    train_list: str = "data/vox2/train_lips.txt"
    val_list: str = "data/vox2/val_lips.txt"
    out_dir: str = "exp/avsync"
    clip_frames: int = 5
    max_offset: int = 15
    batch_size: int = 64
    lr: float = 1e-4
    epochs: int = 40
    num_workers: int = 10
    log_every: int = 100
    emb_dim: int = 1024
    temperature: float = 0.07
    seed: int = 0
    extra: dict = field(default_factory=dict)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    a = ap.parse_args()
    cfg = Config()
    if a.config:
        with open(a.config) as f:
            for k, v in json.load(f).items():
                setattr(cfg, k, v)
    return cfg


class SyncPairs(Dataset):
    """Each line: <lips.npy (T x 96 x 96)> <mel.npy (4T x 80)>."""

    def __init__(self, list_file, clip_frames, max_offset, train):
        self.rows = [l.split() for l in open(list_file) if l.strip()]
        self.k, self.m, self.train = clip_frames, max_offset, train

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        lips = np.load(self.rows[i][0], mmap_mode="r")
        mel = np.load(self.rows[i][1], mmap_mode="r")
        T = min(lips.shape[0], mel.shape[0] // 4)
        lo, hi = self.m, T - self.k - self.m
        if hi <= lo:  # utterance too short for the full offset range: take another one
            return self[random.randrange(len(self))]
        s = random.randint(lo, hi) if self.train else (lo + hi) // 2
        v = torch.from_numpy(np.array(lips[s:s + self.k], dtype=np.float32) / 255.0)
        crop = random.randint(0, 8) if self.train else 4
        v = v[:, crop:crop + 88, crop:crop + 88]
        # candidate audio windows for offsets -m..+m
        a = np.stack([mel[4 * (s + o): 4 * (s + o + self.k)] for o in range(-self.m, self.m + 1)])
        a = torch.from_numpy(a.astype(np.float32))
        a = (a - a.mean()) / (a.std() + 1e-5)
        return (v - 0.421) / 0.165, a  # (k, 88, 88), (2m+1, 4k, 80)


class VisualStream(nn.Module):
    def __init__(self, dim):
        super().__init__()

        def block(ci, co, k, s, p):
            return nn.Sequential(nn.Conv3d(ci, co, k, s, p, bias=False), nn.BatchNorm3d(co), nn.ReLU(inplace=True))

        self.net = nn.Sequential(
            block(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3)), nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)),
            block(64, 128, (1, 5, 5), (1, 2, 2), (0, 2, 2)),
            block(128, 256, (1, 3, 3), (1, 1, 1), (0, 1, 1)),
            block(256, 256, (1, 3, 3), (1, 2, 2), (0, 1, 1)),
            block(256, 512, (5, 3, 3), (1, 1, 1), (0, 1, 1)),
            nn.AdaptiveAvgPool3d(1))
        self.fc = nn.Linear(512, dim)

    def forward(self, v):  # B, k, H, W
        return F.normalize(self.fc(self.net(v.unsqueeze(1)).flatten(1)), dim=-1)


class AudioStream(nn.Module):
    def __init__(self, dim):
        super().__init__()

        def block(ci, co, s):
            return nn.Sequential(nn.Conv2d(ci, co, 3, s, 1, bias=False), nn.BatchNorm2d(co), nn.ReLU(inplace=True))

        self.net = nn.Sequential(block(1, 64, 1), block(64, 128, (1, 2)), block(128, 256, 2),
                                 block(256, 256, (1, 2)), block(256, 512, 2), nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(512, dim)

    def forward(self, a):  # N, 4k, 80
        return F.normalize(self.fc(self.net(a.unsqueeze(1)).flatten(1)), dim=-1)


class SyncNet(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.visual = VisualStream(dim)
        self.audio = AudioStream(dim)

    def forward(self, v, a):
        b, n = a.shape[:2]
        ev = self.visual(v)
        ea = self.audio(a.flatten(0, 1)).view(b, n, -1)
        return torch.einsum("bd,bnd->bn", ev, ea)


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        logging.basicConfig(level=logging.INFO if self.rank == 0 else logging.WARNING,
                            format="%(asctime)s | %(message)s")
        random.seed(cfg.seed + self.rank)
        torch.manual_seed(cfg.seed)

        self.train_set = SyncPairs(cfg.train_list, cfg.clip_frames, cfg.max_offset, train=True)
        self.val_set = SyncPairs(cfg.val_list, cfg.clip_frames, cfg.max_offset, train=False)
        self.train_loader = DataLoader(self.train_set, batch_size=cfg.batch_size, shuffle=True,
                                       num_workers=cfg.num_workers, pin_memory=True, drop_last=True,
                                       persistent_workers=True)
        self.val_loader = DataLoader(self.val_set, batch_size=cfg.batch_size, num_workers=cfg.num_workers)

        net = nn.SyncBatchNorm.convert_sync_batchnorm(SyncNet(cfg.emb_dim)).to(self.device)
        self.model = DDP(net, device_ids=[self.local_rank])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.sched = torch.optim.lr_scheduler.MultiStepLR(self.opt, milestones=[20, 30], gamma=0.1)
        self.target = cfg.max_offset  # index of the zero offset
        self.best = 0.0
        if self.rank == 0:
            os.makedirs(cfg.out_dir, exist_ok=True)

    def train_epoch(self, epoch):
        self.model.train()
        t0 = time.time()
        for it, (v, a) in enumerate(self.train_loader):
            v, a = v.to(self.device, non_blocking=True), a.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = self.model(v, a).float() / self.cfg.temperature
            target = torch.full((v.size(0),), self.target, device=self.device)
            loss = F.cross_entropy(logits, target)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            if it % self.cfg.log_every == 0:
                acc = (logits.argmax(1) == target).float().mean()
                logger.info("epoch %d it %d/%d loss %.3f acc %.3f (%.1f clips/s/gpu)", epoch, it,
                            len(self.train_loader), loss.item(), acc.item(),
                            (it + 1) * v.size(0) / (time.time() - t0))
        self.sched.step()

    @torch.no_grad()
    def validate(self):
        net = self.model.module
        net.eval()
        correct = within1 = n = 0
        for v, a in self.val_loader:
            v, a = v.to(self.device), a.to(self.device)
            pred = net(v, a).argmax(1)
            correct += (pred == self.target).sum().item()
            within1 += ((pred - self.target).abs() <= 1).sum().item()
            n += v.size(0)
        net.train()
        return correct / n, within1 / n

    def save(self, epoch, name):
        torch.save({"model": self.model.module.state_dict(), "optimizer": self.opt.state_dict(),
                    "epoch": epoch}, os.path.join(self.cfg.out_dir, name))

    def fit(self):
        for epoch in range(self.cfg.epochs):
            self.train_epoch(epoch)
            if self.rank == 0:
                acc, acc1 = self.validate()
                logger.info("epoch %d val offset acc %.4f (+-1 frame %.4f)", epoch, acc, acc1)
                self.save(epoch, "last.pt")
                if acc > self.best:
                    self.best = acc
                    self.save(epoch, "best.pt")
            dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    Trainer(load_config()).fit()
