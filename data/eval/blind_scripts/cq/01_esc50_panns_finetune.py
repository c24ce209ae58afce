#!/usr/bin/env python
"""Fine-tune PANNs Cnn14 (AudioSet-pretrained) on ESC-50, one fold held out.

    torchrun --nproc_per_node=4 01_esc50_panns_finetune.py \
        --data-root /data/ESC-50-master --pretrained ckpt/Cnn14_mAP=0.431.pth --fold 1
"""
import argparse
import json
import logging
import os
import time

import librosa
import numpy as np
import pandas as pd
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torchaudio.transforms import AmplitudeToDB, FrequencyMasking, MelSpectrogram, TimeMasking

log = logging.getLogger("esc50")

SR = 32000
CLIP_LEN = 5 * SR


class ESC50(Dataset):
    def __init__(self, root, folds, train):
        meta = pd.read_csv(os.path.join(root, "meta", "esc50.csv"))
        meta = meta[meta["fold"].isin(folds)].reset_index(drop=True)
        self.paths = [os.path.join(root, "audio", f) for f in meta["filename"]]
        self.labels = meta["target"].to_numpy(dtype=np.int64)
        self.train = train

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        wav, sr = sf.read(self.paths[i], dtype="float32", always_2d=False)
        if wav.ndim == 2:
            wav = wav.mean(axis=1)
        if sr != SR:
            wav = librosa.resample(wav, orig_sr=sr, target_sr=SR)
        if len(wav) < CLIP_LEN:
            wav = np.pad(wav, (0, CLIP_LEN - len(wav)))
        wav = wav[:CLIP_LEN]
        if self.train:
            wav = np.roll(wav, np.random.randint(0, CLIP_LEN))
            wav = wav * (10 ** (np.random.uniform(-6, 6) / 20))
        return torch.from_numpy(wav.astype(np.float32)), self.labels[i]


class EvalShard(Sampler):
    """Strided shard of the eval set without DistributedSampler's padding."""

    def __init__(self, n, rank, world):
        self.idx = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return len(self.idx)


class LogMel(nn.Module):
    def __init__(self, specaug=True):
        super().__init__()
        self.mel = MelSpectrogram(SR, n_fft=1024, win_length=1024, hop_length=320,
                                  f_min=50, f_max=14000, n_mels=64, power=2.0)
        self.db = AmplitudeToDB(stype="power", top_db=None)
        self.specaug = nn.Sequential(FrequencyMasking(8), FrequencyMasking(8),
                                     TimeMasking(64), TimeMasking(64)) if specaug else None

    @torch.no_grad()
    def forward(self, wav):
        x = self.db(self.mel(wav))              # (B, mel, T)
        if self.training and self.specaug is not None:
            x = self.specaug(x)
        return x.transpose(1, 2).unsqueeze(1)   # (B, 1, T, mel)


class ConvBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.bn2 = nn.BatchNorm2d(cout)

    def forward(self, x, pool=(2, 2)):
        x = F.relu_(self.bn1(self.conv1(x)))
        x = F.relu_(self.bn2(self.conv2(x)))
        return F.avg_pool2d(x, pool)


class Cnn14(nn.Module):
    def __init__(self, classes_num=527):
        super().__init__()
        self.bn0 = nn.BatchNorm2d(64)
        chans = [1, 64, 128, 256, 512, 1024, 2048]
        for k in range(6):
            setattr(self, f"conv_block{k + 1}", ConvBlock(chans[k], chans[k + 1]))
        self.fc1 = nn.Linear(2048, 2048)
        self.fc_audioset = nn.Linear(2048, classes_num)

    def embed(self, x):
        x = self.bn0(x.transpose(1, 3)).transpose(1, 3)
        for k in range(6):
            x = getattr(self, f"conv_block{k + 1}")(x, pool=(2, 2) if k < 5 else (1, 1))
            x = F.dropout(x, 0.2, self.training)
        x = x.mean(dim=3)
        x = x.max(dim=2)[0] + x.mean(dim=2)
        x = F.dropout(x, 0.5, self.training)
        return F.relu_(self.fc1(x))

    def forward(self, x):
        return self.fc_audioset(F.dropout(self.embed(x), 0.5, self.training))


def build_model(pretrained, num_classes):
    model = Cnn14(classes_num=527)
    if pretrained:
        checkpoint = torch.load(pretrained)
        state = {k: v for k, v in checkpoint["model"].items()
                 if not k.startswith(("spectrogram_extractor", "logmel_extractor"))}
        missing, unexpected = model.load_state_dict(state, strict=False)
        log.info("loaded %s (missing=%d, unexpected=%d)", pretrained, len(missing), len(unexpected))
    model.fc_audioset = nn.Linear(2048, num_classes)
    return model


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", required=True)
    p.add_argument("--pretrained", default="")
    p.add_argument("--fold", type=int, default=1)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-4, help="for the global batch of 128")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="runs/esc50")
    p.add_argument("--resume", default="")
    return p.parse_args()


@torch.no_grad()
def evaluate(net, frontend, loader, device):
    net.eval()
    frontend.eval()
    stats = torch.zeros(3, device=device)  # correct, count, loss_sum
    for wav, y in loader:
        wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = net(frontend(wav))
        stats[0] += (logits.argmax(1) == y).sum()
        stats[1] += y.numel()
        stats[2] += F.cross_entropy(logits, y, reduction="sum")
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item(), (stats[2] / stats[1]).item()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(1234 + rank)

    train_folds = [f for f in range(1, 6) if f != args.fold]
    train_set = ESC50(args.data_root, train_folds, train=True)
    test_set = ESC50(args.data_root, [args.fold], train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    test_loader = DataLoader(test_set, batch_size=64, sampler=EvalShard(len(test_set), rank, world),
                             num_workers=args.workers, pin_memory=True)

    model = build_model(args.pretrained, num_classes=50)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    frontend = LogMel().to(device)

    lr = args.lr * (args.batch_size * world) / 128
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-2)
    steps_per_epoch = len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, epochs=args.epochs,
                                                steps_per_epoch=steps_per_epoch, pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best_acc = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        frontend.train()
        t0, running = time.time(), 0.0
        for step, (wav, y) in enumerate(train_loader):
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x = frontend(wav)
            # mixup within the local batch
            lam = np.random.beta(0.4, 0.4)
            perm = torch.randperm(x.size(0), device=device)
            x = lam * x + (1 - lam) * x[perm]
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(x)
                loss = lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y[perm])
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            running += loss.item()
            if rank == 0 and step % 20 == 0:
                log.info("ep %d step %d/%d loss %.4f lr %.2e", epoch, step, steps_per_epoch,
                         loss.item(), sched.get_last_lr()[0])

        acc, val_loss = evaluate(model.module, frontend, test_loader, device)
        if rank == 0:
            log.info("epoch %d train_loss %.4f val_loss %.4f acc %.4f (%.0fs)", epoch,
                     running / steps_per_epoch, val_loss, acc, time.time() - t0)
            ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "scaler": scaler.state_dict(),
                    "epoch": epoch, "best_acc": max(best_acc, acc)}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if acc > best_acc:
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
        best_acc = max(best_acc, acc)
        dist.barrier()

    if rank == 0:
        log.info("fold %d best acc %.4f", args.fold, best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
