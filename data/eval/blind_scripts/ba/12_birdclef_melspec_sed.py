"""BirdCLEF 2023 - mel-spectrogram CNN (timm backbone), 5s random crops, mixup, padded cmAP.

torchrun --nproc_per_node=4 12_birdclef_melspec_sed.py --backbone eca_nfnet_l0 --fold 0
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import sklearn.metrics
import soundfile as sf
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SR = 32000
CLIP = 5 * SR


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/birdclef-2023")
    p.add_argument("--backbone", default="eca_nfnet_l0")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--mixup", type=float, default=0.5)
    p.add_argument("--out", default="./bc23")
    return p.parse_args()


class ClipDS(Dataset):
    def __init__(self, df, audio_dir, n_classes, train):
        self.files = df.filename.values
        self.labels = df.label_idx.values
        self.audio_dir, self.n_classes, self.train = audio_dir, n_classes, train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        wav, sr = sf.read(os.path.join(self.audio_dir, self.files[i]), dtype="float32", always_2d=False)
        if wav.ndim > 1:
            wav = wav.mean(1)
        if len(wav) < CLIP:
            wav = np.pad(wav, (0, CLIP - len(wav)))
        start = np.random.randint(0, len(wav) - CLIP + 1) if self.train else 0
        wav = wav[start:start + CLIP]
        y = np.zeros(self.n_classes, dtype=np.float32)
        y[self.labels[i]] = 1.0
        return torch.from_numpy(wav.copy()), torch.from_numpy(y), i


class MelFrontEnd(nn.Module):
    def __init__(self):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(SR, n_fft=2048, hop_length=512, n_mels=128, f_min=40, f_max=15000)
        self.db = torchaudio.transforms.AmplitudeToDB(top_db=80)

    def forward(self, wav):
        x = self.db(self.mel(wav)).unsqueeze(1)
        mu = x.mean(dim=(2, 3), keepdim=True)
        sd = x.std(dim=(2, 3), keepdim=True)
        return (x - mu) / (sd + 1e-6)


class BirdNet(nn.Module):
    def __init__(self, backbone, n_classes):
        super().__init__()
        self.front = MelFrontEnd()
        self.cnn = timm.create_model(backbone, pretrained=True, in_chans=1, num_classes=n_classes, drop_rate=0.2)

    def forward(self, wav):
        with torch.cuda.amp.autocast(enabled=False):
            spec = self.front(wav.float())
        return self.cnn(spec)


def padded_cmap(y_true, y_pred, pad=5):
    ones = np.ones((pad, y_true.shape[1]))
    return sklearn.metrics.average_precision_score(np.vstack([y_true, ones]), np.vstack([y_pred, ones]), average="macro")


def mixup(x, y, alpha):
    lam = np.random.beta(alpha, alpha)
    perm = torch.randperm(x.size(0), device=x.device)
    return lam * x + (1 - lam) * x[perm], lam * y + (1 - lam) * y[perm]


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    idx, P, Y = [], [], []
    for wav, y, i in loader:
        with torch.cuda.amp.autocast():
            P.append(torch.sigmoid(net(wav.to(device)).float()).cpu().numpy())
        Y.append(y.numpy())
        idx.append(i.numpy())
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (np.concatenate(idx), np.concatenate(P), np.concatenate(Y)))
    idx = np.concatenate([p[0] for p in parts])
    keep = np.unique(idx, return_index=True)[1]
    P = np.concatenate([p[1] for p in parts])[keep]
    Y = np.concatenate([p[2] for p in parts])[keep]
    return padded_cmap(Y, P)


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    np.random.seed(1234 + rank)  # different crops / mixup per rank
    torch.manual_seed(1234)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    meta = pd.read_csv(os.path.join(args.root, "train_metadata_folds.csv"))
    classes = sorted(meta.primary_label.unique())
    meta["label_idx"] = meta.primary_label.map({c: i for i, c in enumerate(classes)})
    trn, val = meta[meta.fold != args.fold].reset_index(drop=True), meta[meta.fold == args.fold].reset_index(drop=True)
    audio_dir = os.path.join(args.root, "train_audio")
    trn_ds, val_ds = ClipDS(trn, audio_dir, len(classes), True), ClipDS(val, audio_dir, len(classes), False)
    trn_s = DistributedSampler(trn_ds, shuffle=True, drop_last=True)
    val_s = DistributedSampler(val_ds, shuffle=False)
    trn_dl = DataLoader(trn_ds, batch_size=args.bs, sampler=trn_s, num_workers=8, pin_memory=True, drop_last=True,
                        persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.bs, sampler=val_s, num_workers=8)

    model = BirdNet(args.backbone, len(classes)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(trn_dl), pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler()
    bce = nn.BCEWithLogitsLoss()

    best = 0.0
    for epoch in range(args.epochs):
        trn_s.set_epoch(epoch)
        model.train()
        t0, agg, skipped = time.time(), torch.zeros(2, device=device), 0
        for wav, y, _ in trn_dl:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if np.random.rand() < args.mixup:
                wav, y = mixup(wav, y, 0.4)
            with torch.cuda.amp.autocast():
                logits = model(wav)
                loss = bce(logits, y)
            if not torch.isfinite(loss):
                skipped += 1
                continue
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            agg += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(agg)
        score = validate(model.module, val_dl, device)
        if rank == 0:
            print(f"ep {epoch} loss {(agg[0] / agg[1]).item():.4f} cmAP {score:.4f} skipped {skipped} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if score > best:
                best = score
                torch.save({"model": model.module.state_dict(), "classes": classes},
                           os.path.join(args.out, f"{args.backbone}_f{args.fold}.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
