"""BirdCLEF: 5-fold CNN on log-mel spectrograms (multi-label), DDP over 4 GPUs.

    torchrun --nproc_per_node=4 09_birdclef_sed_folds.py --meta data/train_metadata.csv --audio data/train_audio
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import soundfile as sf
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
from sklearn.metrics import average_precision_score
from sklearn.model_selection import StratifiedKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SR = 32000
CLIP = 5 * SR


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--meta", required=True)
    ap.add_argument("--audio", required=True)
    ap.add_argument("--out", default="ckpt/birdclef_effv2s")
    ap.add_argument("--backbone", default="tf_efficientnetv2_s.in21k_ft_in1k")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--mixup", type=float, default=0.5)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def padded_cmap(y_true, y_pred, pad=5):
    # competition metric: macro AP with `pad` rows of all-positive appended
    ones = np.ones((pad, y_true.shape[1]))
    y_true = np.concatenate([y_true, ones])
    y_pred = np.concatenate([y_pred, ones])
    return float(average_precision_score(y_true, y_pred, average="macro"))


class ClipDataset(Dataset):
    def __init__(self, df, audio_dir, n_classes, train):
        self.files = [os.path.join(audio_dir, f) for f in df["filename"]]
        self.labels = df["label_id"].to_numpy()
        self.secondary = df["secondary_ids"].tolist()
        self.rows = df.index.to_numpy()
        self.n_classes = n_classes
        self.train = train

    def __len__(self):
        return len(self.files)

    def _load(self, path):
        info = sf.info(path)
        n = info.frames
        if self.train and n > CLIP:
            start = np.random.randint(0, n - CLIP)
        else:
            start = 0
        wav, _ = sf.read(path, start=start, frames=CLIP, dtype="float32", always_2d=True)
        wav = wav.mean(1)
        if len(wav) < CLIP:
            wav = np.pad(wav, (0, CLIP - len(wav)))
        return wav

    def __getitem__(self, i):
        wav = torch.from_numpy(self._load(self.files[i]))
        y = torch.zeros(self.n_classes)
        y[self.labels[i]] = 1.0
        for s in self.secondary[i]:
            y[s] = 0.5
        return wav, y, self.rows[i]


class BirdNet(nn.Module):
    def __init__(self, backbone, n_classes):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(SR, n_fft=2048, hop_length=512, n_mels=128,
                                                        f_min=40, f_max=15000)
        self.db = torchaudio.transforms.AmplitudeToDB(top_db=80)
        self.cnn = timm.create_model(backbone, pretrained=True, in_chans=1, num_classes=n_classes,
                                     drop_rate=0.2, drop_path_rate=0.2)

    def forward(self, wav):
        with torch.autocast("cuda", enabled=False):
            x = self.db(self.mel(wav.float())).unsqueeze(1)
            x = (x - x.mean((2, 3), keepdim=True)) / (x.std((2, 3), keepdim=True) + 1e-6)
        return self.cnn(x)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    ys, ps, loss_sum, n = [], [], 0.0, 0
    crit = nn.BCEWithLogitsLoss(reduction="sum")
    for wav, y, _ in loader:
        wav, y = wav.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logit = model(wav)
        loss_sum += crit(logit.float(), (y > 0).float()).item()
        n += y.numel()
        ps.append(torch.sigmoid(logit.float()).cpu().numpy())
        ys.append((y > 0).float().cpu().numpy())
    y_true, y_pred = np.concatenate(ys), np.concatenate(ps)
    return loss_sum / n, padded_cmap(y_true, y_pred)


@torch.no_grad()
def predict_oof(model, loader, device, world_size):
    model.eval()
    rows, ps = [], []
    for wav, _, r in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            ps.append(torch.sigmoid(model(wav.to(device)).float()).cpu().numpy())
        rows.append(r.numpy())
    parts = [None] * world_size
    dist.all_gather_object(parts, (np.concatenate(rows), np.concatenate(ps)))
    rows = np.concatenate([p[0] for p in parts])
    ps = np.concatenate([p[1] for p in parts])
    rows, keep = np.unique(rows, return_index=True)
    return rows, ps[keep]


def run_fold(fold, df, n_classes, args, rank, local_rank, world_size):
    device = torch.device("cuda", local_rank)
    tr_ds = ClipDataset(df[df.fold != fold], args.audio, n_classes, train=True)
    va_ds = ClipDataset(df[df.fold == fold], args.audio, n_classes, train=False)
    tr_sampler = DistributedSampler(tr_ds, shuffle=True)
    tr_dl = DataLoader(tr_ds, args.bs, sampler=tr_sampler, num_workers=args.workers, drop_last=True,
                       pin_memory=True, persistent_workers=True)
    va_dl = DataLoader(va_ds, args.bs, sampler=DistributedSampler(va_ds, shuffle=False),
                       num_workers=args.workers, pin_memory=True)

    model = DDP(BirdNet(args.backbone, n_classes).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(tr_dl), eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    crit = nn.BCEWithLogitsLoss()

    best_cmap = -1.0
    ckpt = os.path.join(args.out, f"fold{fold}.pt")
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for wav, y, _ in tr_dl:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if np.random.rand() < args.mixup:
                lam = np.random.beta(1.5, 1.5)
                perm = torch.randperm(wav.size(0), device=device)
                wav = lam * wav + (1 - lam) * wav[perm]
                y = torch.maximum(y, y[perm])
            with torch.autocast("cuda", dtype=torch.float16):
                loss = crit(model(wav).float(), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()

        val_loss, cmap = validate(model, va_dl, device)
        if rank == 0:
            print(f"[fold {fold}] ep {epoch:02d} val_loss {val_loss:.5f} cmAP {cmap:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if cmap > best_cmap:
                best_cmap = cmap
                torch.save(model.module.state_dict(), ckpt)

    dist.barrier()
    model.module.load_state_dict(torch.load(ckpt, map_location=device))
    return predict_oof(model, va_dl, device, world_size)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.out, exist_ok=True)

    df = pd.read_csv(args.meta)
    species = sorted(df["primary_label"].unique())
    sp2id = {s: i for i, s in enumerate(species)}
    df["label_id"] = df["primary_label"].map(sp2id)
    df["secondary_ids"] = df["secondary_labels"].apply(
        lambda s: [sp2id[x] for x in eval(s) if x in sp2id])
    # species with a single recording always go to the training side
    counts = df["primary_label"].value_counts()
    df["fold"] = -1
    multi = df[df["primary_label"].map(counts) >= args.folds].index
    skf = StratifiedKFold(n_splits=args.folds, shuffle=True, random_state=42)
    for f, (_, va) in enumerate(skf.split(multi, df.loc[multi, "primary_label"])):
        df.loc[multi[va], "fold"] = f

    oof = np.zeros((len(df), len(species)), np.float32)
    for fold in range(args.folds):
        rows, probs = run_fold(fold, df, len(species), args, rank, local_rank, world_size)
        oof[rows] = probs
        torch.cuda.empty_cache()

    if rank == 0:
        mask = df["fold"].to_numpy() >= 0
        y = np.zeros_like(oof)
        y[np.arange(len(df)), df["label_id"].to_numpy()] = 1
        print(f"OOF padded cmAP {padded_cmap(y[mask], oof[mask]):.4f}")
        np.save(os.path.join(args.out, "oof.npy"), oof)
        df[["filename", "primary_label", "fold"]].to_csv(os.path.join(args.out, "folds.csv"), index=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
