"""Thin-ResNet34 speaker verification on VoxCeleb2 dev, AAM-softmax (m=0.2, s=30).

    torchrun --standalone --nproc_per_node=4 07_resnet34_sv_trainer.py --train_csv lists/vox2_dev.csv
"""
import argparse
import csv
import logging
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("sv")


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.short(x))


class ResNet34SV(nn.Module):
    def __init__(self, n_mels=80, base=32, emb_dim=256):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, base, 3, 1, 1, bias=False), nn.BatchNorm2d(base), nn.ReLU())
        layers, cin = [], base
        for mult, n, stride in [(1, 3, 1), (2, 4, 2), (4, 6, 2), (8, 3, 2)]:
            for j in range(n):
                layers.append(BasicBlock(cin, base * mult, stride if j == 0 else 1))
                cin = base * mult
        self.body = nn.Sequential(*layers)
        fdim = cin * (n_mels // 8)
        self.fc = nn.Linear(fdim * 2, emb_dim)

    def forward(self, x):                  # x: (B, T, F)
        x = self.body(self.stem(x.transpose(1, 2).unsqueeze(1)))
        x = x.flatten(1, 2)                 # (B, C*F', T')
        stats = torch.cat([x.mean(-1), x.std(-1).clamp(min=1e-4)], dim=1)
        return self.fc(stats)


class AAMHead(nn.Module):
    def __init__(self, emb_dim, n_spk, m=0.2, s=30.0):
        super().__init__()
        self.W = nn.Parameter(torch.randn(n_spk, emb_dim) * 0.01)
        self.m, self.s = m, s

    def forward(self, emb, y):
        cos = F.linear(F.normalize(emb), F.normalize(self.W)).clamp(-1 + 1e-7, 1 - 1e-7)
        theta = torch.acos(cos)
        target = torch.cos(theta + self.m)
        logits = torch.where(F.one_hot(y, cos.size(1)).bool(), target, cos) * self.s
        return F.cross_entropy(logits, y)


class Net(nn.Module):
    def __init__(self, n_spk, args):
        super().__init__()
        self.backbone = ResNet34SV(args.n_mels, args.base, args.emb_dim)
        self.head = AAMHead(args.emb_dim, n_spk, args.margin, args.scale)

    def forward(self, feats, y):
        return self.head(self.backbone(feats), y)


class FbankExtractor:
    def __init__(self, n_mels):
        self.n_mels = n_mels

    def __call__(self, wav):
        fb = torchaudio.compliance.kaldi.fbank(wav.unsqueeze(0) * (1 << 15), num_mel_bins=self.n_mels,
                                               frame_length=25, frame_shift=10, dither=1.0)
        return fb - fb.mean(0, keepdim=True)


class VoxCrops(Dataset):
    def __init__(self, csv_path, root, n_mels, crop_frames=200, musan=None):
        with open(csv_path) as f:
            rows = list(csv.reader(f))[1:]
        speakers = sorted({r[0] for r in rows})
        self.spk2idx = {s: i for i, s in enumerate(speakers)}
        self.items = [(os.path.join(root, r[1]), self.spk2idx[r[0]]) for r in rows]
        self.crop = crop_frames * 160 + 240
        self.fbank = FbankExtractor(n_mels)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        path, y = self.items[idx]
        info = sf.info(path)
        if info.frames > self.crop:
            start = random.randint(0, info.frames - self.crop)
            wav, _ = sf.read(path, start=start, frames=self.crop, dtype="float32")
        else:
            wav, _ = sf.read(path, dtype="float32")
            wav = np.pad(wav, (0, self.crop - len(wav)), mode="wrap")
        gain = 10 ** (random.uniform(-6, 6) / 20)
        return self.fbank(torch.from_numpy(wav) * gain), y


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)

        self.train_set = VoxCrops(args.train_csv, args.wav_root, args.n_mels)
        self.sampler = DistributedSampler(self.train_set, shuffle=True, drop_last=True)
        self.loader = DataLoader(self.train_set, batch_size=args.batch_size, sampler=self.sampler,
                                 num_workers=args.workers, pin_memory=True, drop_last=True,
                                 prefetch_factor=4, persistent_workers=True)

        net = Net(len(self.train_set.spk2idx), args)
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
        self.model = DDP(net.to(self.device), device_ids=[self.local_rank])
        self.opt = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9,
                                   weight_decay=1e-4, nesterov=True)
        iters = args.epochs * len(self.loader)
        warm = args.warmup_epochs * len(self.loader)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda i: (i + 1) / warm if i < warm else 0.5 * (1 + math.cos(math.pi * (i - warm) / (iters - warm))))
        self.start_epoch = 0
        if args.resume:
            self.load(args.resume)

    def load(self, path):
        ckpt = torch.load(path, map_location="cpu")
        self.model.module.load_state_dict(ckpt["net"])
        self.opt.load_state_dict(ckpt["opt"])
        self.sched.load_state_dict(ckpt["sched"])
        self.start_epoch = ckpt["epoch"] + 1

    def save(self, epoch):
        if self.rank != 0:
            return
        os.makedirs(self.args.exp, exist_ok=True)
        torch.save({"net": self.model.module.state_dict(), "opt": self.opt.state_dict(),
                    "sched": self.sched.state_dict(), "epoch": epoch},
                   os.path.join(self.args.exp, f"model_{epoch:03d}.pt"))

    def train_epoch(self, epoch):
        self.model.train()
        total = torch.zeros(1, device=self.device)
        for it, (feats, y) in enumerate(self.loader):
            feats = feats.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = self.model(feats, y)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.sched.step()
            total += loss.detach()
            if self.rank == 0 and it % 100 == 0:
                logger.info("epoch %d iter %d/%d loss %.4f lr %.5f", epoch, it, len(self.loader),
                            loss.item(), self.sched.get_last_lr()[0])
        dist.all_reduce(total)
        return total.item() / (self.world * len(self.loader))

    @torch.no_grad()
    def eval_eer(self):
        backbone = self.model.module.backbone
        backbone.eval()
        trials = [l.split() for l in open(self.args.trials)]
        utts = sorted({t[1] for t in trials} | {t[2] for t in trials})
        fbank = FbankExtractor(self.args.n_mels)
        mine = {}
        for u in utts[self.rank::self.world]:
            wav, _ = sf.read(os.path.join(self.args.test_root, u), dtype="float32")
            feats = fbank(torch.from_numpy(wav)).unsqueeze(0).to(self.device)
            mine[u] = F.normalize(backbone(feats), dim=1)[0].cpu()
        parts = [None] * self.world
        dist.all_gather_object(parts, mine)
        backbone.train()
        if self.rank != 0:
            return None
        emb = {}
        for p in parts:
            emb.update(p)
        scores = np.array([float(emb[a] @ emb[b]) for _, a, b in trials])
        labels = np.array([int(t[0]) for t in trials])
        thr = np.sort(scores)
        far = np.array([(scores[labels == 0] >= t).mean() for t in thr[:: max(1, len(thr) // 2000)]])
        frr = np.array([(scores[labels == 1] < t).mean() for t in thr[:: max(1, len(thr) // 2000)]])
        i = np.argmin(np.abs(far - frr))
        return 100 * (far[i] + frr[i]) / 2

    def fit(self):
        for epoch in range(self.start_epoch, self.args.epochs):
            loss = self.train_epoch(epoch)
            eer = self.eval_eer() if (epoch + 1) % self.args.eval_every == 0 else None
            if self.rank == 0:
                logger.info("epoch %d mean loss %.4f%s", epoch, loss,
                            f" | Vox1-O EER {eer:.3f}%" if eer is not None else "")
            self.save(epoch)
            dist.barrier()
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_csv", default="lists/vox2_dev.csv")
    ap.add_argument("--wav_root", default="/data/voxceleb2/dev/wav")
    ap.add_argument("--trials", default="lists/veri_test2.txt")
    ap.add_argument("--test_root", default="/data/voxceleb1/test/wav")
    ap.add_argument("--exp", default="exp/resnet34_aam")
    ap.add_argument("--n_mels", type=int, default=80)
    ap.add_argument("--base", type=int, default=32)
    ap.add_argument("--emb_dim", type=int, default=256)
    ap.add_argument("--margin", type=float, default=0.2)
    ap.add_argument("--scale", type=float, default=30.0)
    ap.add_argument("--batch_size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--warmup_epochs", type=int, default=3)
    ap.add_argument("--eval_every", type=int, default=5)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    Trainer(args).fit()


if __name__ == "__main__":
    main()
