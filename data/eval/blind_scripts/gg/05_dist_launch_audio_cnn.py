#!/usr/bin/env python3
"""Environmental-sound classifier (log-mel CNN) with a retrying job wrapper.

    python 05_dist_launch_audio_cnn.py --nproc 4 --csv meta/esc50.csv --audio-dir audio/ --fold 5

Without --worker the script wraps itself in `python -m torch.distributed.launch`,
re-running the job up to --retries times; with --worker it is the per-GPU
training process. Each rank logs to <out>/rank<k>.log.
Tested with PyTorch 2.1 / torchaudio 2.1.
"""
import argparse
import logging
import os
import subprocess
import sys
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--master-port", type=int, default=29533)
    p.add_argument("--retries", type=int, default=2)
    p.add_argument("--csv", default="meta/esc50.csv")
    p.add_argument("--audio-dir", default="audio")
    p.add_argument("--fold", type=int, default=5, help="held-out fold")
    p.add_argument("--out", default="runs/esc50_cnn")
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=128, help="global batch, split over GPUs")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--sample-rate", type=int, default=32000)
    return p


class ClipDataset(Dataset):
    def __init__(self, df, audio_dir, sample_rate, train):
        self.files = df["filename"].tolist()
        self.targets = df["target"].tolist()
        self.audio_dir = audio_dir
        self.sr = sample_rate
        self.train = train
        self.num_samples = 5 * sample_rate

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        wav, sr = torchaudio.load(os.path.join(self.audio_dir, self.files[i]))
        wav = wav.mean(0)
        if sr != self.sr:
            wav = torchaudio.functional.resample(wav, sr, self.sr)
        wav = F.pad(wav, (0, max(0, self.num_samples - wav.numel())))[: self.num_samples]
        if self.train:
            wav = torch.roll(wav, int(torch.randint(0, self.num_samples, ())))
            wav = wav * (10 ** (torch.empty(()).uniform_(-6, 6) / 20))
        return wav, self.targets[i]


class MelCNN(nn.Module):
    def __init__(self, sample_rate, n_classes=50):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(sample_rate, n_fft=1024, hop_length=320, n_mels=128)
        self.db = torchaudio.transforms.AmplitudeToDB(top_db=80)

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                                 nn.AvgPool2d(2))
        self.features = nn.Sequential(block(1, 64), block(64, 128), block(128, 256), block(256, 512))
        self.dropout = nn.Dropout(0.3)
        self.fc = nn.Linear(512, n_classes)

    def forward(self, wav):
        x = self.db(self.mel(wav)).unsqueeze(1)
        x = (x + 40.0) / 40.0
        x = self.features(x)
        x = x.mean(dim=3).amax(dim=2)
        return self.fc(self.dropout(x))


def setup_logger(out, rank):
    os.makedirs(out, exist_ok=True)
    handlers = [logging.FileHandler(os.path.join(out, f"rank{rank}.log"))]
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stdout))
    logging.basicConfig(level=logging.INFO, handlers=handlers,
                        format=f"%(asctime)s r{rank} %(message)s", force=True)
    return logging.getLogger(__name__)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    counts = torch.zeros(2, device=device)
    for wav, y in loader:
        wav, y = wav.to(device), y.to(device)
        counts[0] += (model(wav).argmax(1) == y).sum()
        counts[1] += y.numel()
    dist.all_reduce(counts)
    model.train()
    return (counts[0] / counts[1]).item()


def train(args):
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    log = setup_logger(args.out, rank)

    df = pd.read_csv(args.csv)
    train_df, val_df = df[df.fold != args.fold], df[df.fold == args.fold]
    train_ds = ClipDataset(train_df, args.audio_dir, args.sample_rate, train=True)
    val_ds = ClipDataset(val_df, args.audio_dir, args.sample_rate, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    per_gpu_batch = args.batch_size // world_size
    train_loader = DataLoader(train_ds, batch_size=per_gpu_batch, sampler=sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world_size)),
                            batch_size=64, num_workers=4)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(MelCNN(args.sample_rate)).to(device)
    model = DDP(model, device_ids=[args.local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))

    start, best = 0, 0.0
    ckpt_path = os.path.join(args.out, "last.pt")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optim"])
        scheduler.load_state_dict(ckpt["sched"])
        start, best = ckpt["epoch"] + 1, ckpt["best"]
        log.info("resuming at epoch %d", start)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        loss_sum = torch.zeros((), device=device)
        for wav, y in train_loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(wav), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        acc = evaluate(model.module, val_loader, device)
        log.info("epoch %d loss %.4f val_acc %.4f %.1fs", epoch, loss_sum.item() / len(train_loader),
                 acc, time.time() - t0)
        if rank == 0:
            best = max(best, acc)
            torch.save({"model": model.module.state_dict(), "optim": optimizer.state_dict(),
                        "sched": scheduler.state_dict(), "epoch": epoch, "best": best}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    log.info("best val acc %.4f", best)
    dist.destroy_process_group()


def wrap(args):
    os.makedirs(args.out, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.launch",
           f"--nproc_per_node={args.nproc}", f"--master_port={args.master_port}",
           os.path.abspath(__file__), "--worker"] + sys.argv[1:]
    for attempt in range(args.retries + 1):
        with open(os.path.join(args.out, f"launcher.attempt{attempt}.log"), "w") as logf:
            print(f"attempt {attempt}: {' '.join(cmd)}", flush=True)
            rc = subprocess.call(cmd, stdout=logf, stderr=subprocess.STDOUT)
        if rc == 0:
            return 0
        print(f"attempt {attempt} failed with exit code {rc}", flush=True)
        time.sleep(20)
    return 1


if __name__ == "__main__":
    args = get_parser().parse_args()
    if args.worker:
        train(args)
    else:
        sys.exit(wrap(args))
