"""
Music genre classification on FMA-medium (16 top-level genres) from precomputed log-mel
spectrograms (128 mel x 1292 frames per 30 s clip, stored as .npy under mel_dir/<track_id>.npy).

    torchrun --nproc_per_node=4 11_fma_genre_cnn.py --meta fma_metadata/tracks.csv --mel_dir /data/fma_mel
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import accuracy_score, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CROP = 256  # ~6 s of frames for training crops


def load_meta(tracks_csv, mel_dir):
    tracks = pd.read_csv(tracks_csv, index_col=0, header=[0, 1])
    df = pd.DataFrame({
        "split": tracks[("set", "split")],
        "subset": tracks[("set", "subset")],
        "genre": tracks[("track", "genre_top")],
    })
    df = df[df.subset.isin(["small", "medium"]) & df.genre.notna()]
    df = df[[os.path.exists(os.path.join(mel_dir, f"{tid}.npy")) for tid in df.index]]
    genres = sorted(df.genre.unique())
    df["y"] = df.genre.map({g: i for i, g in enumerate(genres)})
    return df, genres


class MelClips(Dataset):
    def __init__(self, df, mel_dir, train):
        self.ids = df.index.values
        self.ys = df.y.values
        self.mel_dir = mel_dir
        self.train = train

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        m = np.load(os.path.join(self.mel_dir, f"{self.ids[i]}.npy")).astype(np.float32)
        if m.shape[1] < CROP:
            m = np.pad(m, ((0, 0), (0, CROP - m.shape[1])), mode="wrap")
        if self.train:
            s = np.random.randint(0, m.shape[1] - CROP + 1)
            m = m[:, s:s + CROP]
            # SpecAugment-lite: one frequency mask
            f0 = np.random.randint(0, 128 - 16)
            m[f0:f0 + np.random.randint(0, 16)] = m.mean()
        else:
            m = m[:, : (m.shape[1] // CROP) * CROP]  # whole clip, evaluated as CROP-sized chunks
        m = (m + 40.0) / 20.0
        return torch.from_numpy(m)[None], int(self.ys[i])


class ConvBlock(nn.Module):
    def __init__(self, cin, cout, pool):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.pool = nn.MaxPool2d(pool)

    def forward(self, x):
        return self.pool(F.elu(self.bn(self.conv(x))))


class GenreCNN(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        self.features = nn.Sequential(
            ConvBlock(1, 64, (2, 2)), ConvBlock(64, 128, (2, 2)), ConvBlock(128, 128, (2, 4)),
            ConvBlock(128, 256, (2, 4)), ConvBlock(256, 256, (4, 4)),
        )
        self.head = nn.Sequential(nn.Dropout(0.5), nn.Linear(256, n_classes))

    def forward(self, x):
        x = self.features(x)
        x = x.amax(dim=(2, 3))
        return self.head(x)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    y_true, y_pred, loss_sum = [], [], 0.0
    for mel, y in loader:
        mel = mel.to(device)
        # split the full clip into CROP-frame chunks and average the logits
        B, _, F_, T = mel.shape
        chunks = mel.unfold(3, CROP, CROP).permute(0, 3, 1, 2, 4).reshape(-1, 1, F_, CROP)
        logits = model(chunks).view(B, -1, model.head[-1].out_features).mean(1)
        loss_sum += F.cross_entropy(logits, y.to(device), reduction="sum").item()
        y_true.append(y.numpy())
        y_pred.append(logits.argmax(1).cpu().numpy())
    y_true, y_pred = np.concatenate(y_true), np.concatenate(y_pred)
    return loss_sum / len(y_true), accuracy_score(y_true, y_pred), f1_score(y_true, y_pred, average="macro")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--meta", required=True)
    ap.add_argument("--mel_dir", required=True)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="runs/fma_cnn")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    df, genres = load_meta(args.meta, args.mel_dir)
    tr_df, va_df = df[df.split == "training"], df[df.split == "validation"]
    train_ds, val_ds = MelClips(tr_df, args.mel_dir, True), MelClips(va_df, args.mel_dir, False)
    tr_sampler = DistributedSampler(train_ds, shuffle=True)
    va_sampler = DistributedSampler(val_ds, shuffle=False)
    tr_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=tr_sampler, num_workers=6,
                       pin_memory=True, drop_last=True)
    # full clips have different lengths -> one clip per batch
    va_dl = DataLoader(val_ds, batch_size=1, sampler=va_sampler, num_workers=4)

    # class weights against the heavy Rock / Electronic imbalance
    counts = np.bincount(tr_df.y.values, minlength=len(genres)).astype(np.float32)
    cls_w = torch.tensor(counts.sum() / (len(genres) * counts), device=device)

    model = GenreCNN(len(genres)).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=1e-5)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "log.csv"), "w") as f:
            f.write("epoch,train_loss,val_loss,val_acc,val_f1\n")

    best_f1 = 0.0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tl = torch.zeros(2, device=device)
        for mel, y in tr_dl:
            mel, y = mel.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(mel), y, weight=cls_w)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tl += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(tl)
        train_loss = (tl[0] / tl[1]).item()

        val_loss, val_acc, val_f1 = validate(model.module, va_dl, device)
        if rank == 0:
            print(f"epoch {epoch:02d} train {train_loss:.4f} | val loss {val_loss:.4f} acc {val_acc:.4f} "
                  f"F1 {val_f1:.4f} | {time.time() - t0:.0f}s", flush=True)
            with open(os.path.join(args.out, "log.csv"), "a") as f:
                f.write(f"{epoch},{train_loss:.5f},{val_loss:.5f},{val_acc:.5f},{val_f1:.5f}\n")
            if val_f1 > best_f1:
                best_f1 = val_f1
                torch.save({"model": model.module.state_dict(), "genres": genres, "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    if rank == 0:
        print(f"best val macro-F1 {best_f1:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
