"""Sound-event classifier (CNN14-style) on log-mel clips from the field recorders.

#!/bin/bash
#SBATCH --job-name=snd-cnn14
#SBATCH --partition=gpu
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=29511
srun bash -c 'torchrun --nnodes=$SLURM_NNODES --nproc_per_node=4 --node_rank=$SLURM_NODEID \
    --master_addr=$MASTER_ADDR --master_port=$MASTER_PORT \
    train_sound.py --csv /project/sound/meta.csv --audio /project/sound/clips --out /project/sound/runs/cnn14'
"""
import argparse
import os
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

SR = 32000
CLIP = 5 * SR


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True, help="columns: file, label, fold")
    p.add_argument("--audio", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--val-fold", type=int, default=0)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3, help="at a global batch of 256")
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class Clips(Dataset):
    def __init__(self, df, root, classes, train):
        self.files = df["file"].tolist()
        self.labels = [classes.index(l) for l in df["label"]]
        self.root = root
        self.train = train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        wav, sr = torchaudio.load(os.path.join(self.root, self.files[i]))
        wav = wav.mean(0)
        if sr != SR:
            wav = torchaudio.functional.resample(wav, sr, SR)
        if wav.numel() < CLIP:
            wav = F.pad(wav, (0, CLIP - wav.numel()))
        start = torch.randint(0, wav.numel() - CLIP + 1, ()).item() if self.train else 0
        wav = wav[start:start + CLIP]
        if self.train:
            wav = wav * (10 ** (torch.empty(()).uniform_(-6, 6) / 20))
        return wav, self.labels[i]


def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.AvgPool2d(2),
    )


class CNN14(nn.Module):
    def __init__(self, n_classes, n_mels=64):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(SR, n_fft=1024, hop_length=320, n_mels=n_mels)
        self.db = torchaudio.transforms.AmplitudeToDB(top_db=80)
        self.bn0 = nn.BatchNorm2d(n_mels)
        chans = [1, 64, 128, 256, 512, 1024]
        self.blocks = nn.Sequential(*[conv_block(a, b) for a, b in zip(chans[:-1], chans[1:])])
        self.fc = nn.Linear(1024, 1024)
        self.head = nn.Linear(1024, n_classes)

    def forward(self, wav):
        x = self.db(self.mel(wav)).unsqueeze(1)            # B,1,M,T
        x = self.bn0(x.transpose(1, 2)).transpose(1, 2)
        x = self.blocks(x)
        x = x.mean(2)
        x = x.max(-1).values + x.mean(-1)
        x = F.dropout(F.relu(self.fc(x)), 0.5, self.training)
        return self.head(x)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    loss_sum, correct, n = 0.0, 0, 0
    for wav, y in loader:
        wav, y = wav.to(device), y.to(device)
        logits = model(wav)
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
        n += y.numel()
    model.train()
    return loss_sum / n, correct / n


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    meta = pd.read_csv(args.csv)
    classes = sorted(meta["label"].unique())
    train_df = meta[meta["fold"] != args.val_fold]
    val_df = meta[meta["fold"] == args.val_fold]
    train_ds = Clips(train_df, args.audio, classes, train=True)
    val_ds = Clips(val_df, args.audio, classes, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=64, sampler=val_sampler, num_workers=args.workers)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(CNN14(len(classes))).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * args.bs * world / 256, weight_decay=1e-2)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=3)

    os.makedirs(args.out, exist_ok=True)
    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        tr = torch.zeros(2, device=device)
        for wav, y in train_dl:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(wav)
            loss = F.cross_entropy(logits.float(), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tr += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(tr)

        val_loss, val_acc = evaluate(model, val_dl, device)
        plateau.step(val_loss)
        if rank == 0:
            print(f"epoch {epoch:3d} train_loss {(tr[0] / tr[1]).item():.4f} val_loss {val_loss:.4f} "
                  f"val_acc {val_acc:.4f} lr {opt.param_groups[0]['lr']:.2e} ({time.time() - t0:.0f}s)",
                  flush=True)
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save({"model": model.module.state_dict(), "classes": classes, "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
