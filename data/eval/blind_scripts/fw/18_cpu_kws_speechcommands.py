#!/usr/bin/env python
"""Keyword spotting on Speech Commands v2 (35 words) with a log-mel CNN.

Runs on the CPU-only HPC partition: gloo process group across nodes,
several processes per node.

    srun -N 4 --ntasks-per-node=1 -c 48 bash -c 'torchrun --nnodes=4 --nproc_per_node=4 \
        --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 --rdzv_id=$SLURM_JOB_ID \
        18_cpu_kws_speechcommands.py --root /scratch/shared/speech --out /scratch/shared/kws_runs'
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchaudio.datasets import SPEECHCOMMANDS

SAMPLE_RATE = 16000


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3, help="max lr at a global batch of 256")
    p.add_argument("--threads", type=int, default=12)
    p.add_argument("--workers", type=int, default=3)
    return p.parse_args()


class Subsetted(SPEECHCOMMANDS):
    def __init__(self, root, subset):
        super().__init__(root, download=False, subset=subset)


def build_label_map(ds):
    # labels from the directory names, sorted -> identical on every rank
    return {w: i for i, w in enumerate(sorted({os.path.basename(os.path.dirname(p)) for p in ds._walker}))}


class Collate:
    def __init__(self, label_map):
        self.label_map = label_map

    def __call__(self, batch):
        waves, labels = [], []
        for wav, sr, label, *_ in batch:
            wav = wav[0]
            wav = F.pad(wav, (0, SAMPLE_RATE - wav.numel())) if wav.numel() < SAMPLE_RATE else wav[:SAMPLE_RATE]
            waves.append(wav)
            labels.append(self.label_map[label])
        return torch.stack(waves), torch.tensor(labels)


class KWSNet(nn.Module):
    def __init__(self, n_classes, n_mels=64):
        super().__init__()
        self.melspec = torchaudio.transforms.MelSpectrogram(SAMPLE_RATE, n_fft=480, hop_length=160, n_mels=n_mels)
        self.to_db = torchaudio.transforms.AmplitudeToDB()
        chans = [1, 32, 64, 128, 128]
        layers = []
        for cin, cout in zip(chans[:-1], chans[1:]):
            layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                       nn.MaxPool2d(2)]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.3), nn.Linear(128, n_classes))

    def forward(self, wav):
        x = self.to_db(self.melspec(wav) + 1e-6).unsqueeze(1)  # [B,1,mels,T]
        x = self.features(x)
        return self.classifier(x.mean((2, 3)))


def accuracy(model, loader):
    model.eval()
    s = torch.zeros(2)
    with torch.no_grad():
        for wav, y in loader:
            s[0] += (model(wav).argmax(1) == y).sum()
            s[1] += y.numel()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    if rank == 0:
        SPEECHCOMMANDS(args.root, download=True)  # one download, on the shared scratch
    dist.barrier()
    train_ds = Subsetted(args.root, "training")
    val_ds = Subsetted(args.root, "validation")
    test_ds = Subsetted(args.root, "testing")
    label_map = build_label_map(train_ds)
    collate = Collate(label_map)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                              num_workers=args.workers, drop_last=True, persistent_workers=True)

    def shard_loader(ds):
        return DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=256, collate_fn=collate,
                          num_workers=args.workers)

    val_loader, test_loader = shard_loader(val_ds), shard_loader(test_ds)

    torch.manual_seed(0)
    model = KWSNet(len(label_map))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model)
    max_lr = args.lr * (args.batch_size * world / 256) ** 0.5
    optimizer = torch.optim.AdamW(model.parameters(), lr=max_lr, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=max_lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(label_map)} classes, {len(train_ds)} train clips, world {world}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (wav, y) in enumerate(train_loader):
            wav = wav + 0.005 * torch.randn_like(wav)  # light noise augmentation
            loss = F.cross_entropy(model(wav), y, label_smoothing=0.05)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and i % 50 == 0:
                print(f"epoch {epoch} it {i}/{len(train_loader)} loss {loss.item():.3f}", flush=True)

        val_acc = accuracy(model.module, val_loader)
        if rank == 0:
            print(f"epoch {epoch} val acc {val_acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if val_acc > best:
                best = val_acc
                torch.save({"model": model.module.state_dict(), "labels": label_map, "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    # test accuracy of the best model
    ckpt = torch.load(os.path.join(args.out, "best.pt"), map_location="cpu")
    model.module.load_state_dict(ckpt["model"])
    test_acc = accuracy(model.module, test_loader)
    if rank == 0:
        print(f"best val {best:.4f} (epoch {ckpt['epoch']}), test acc {test_acc:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
