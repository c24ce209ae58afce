"""ESC-50 environmental sound classification, log-mel CNN.

Folds 1-4 train, fold 5 validation. Lightning 2.2, DDP on one node.
"""
import argparse
import os

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from sklearn.metrics import confusion_matrix, f1_score
from torch.utils.data import DataLoader, Dataset

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint, EarlyStopping
from lightning.pytorch.loggers import TensorBoardLogger

SR = 44100
N_CLASSES = 50


class ESC50(Dataset):
    def __init__(self, root, folds, train):
        meta = pd.read_csv(os.path.join(root, "meta", "esc50.csv"))
        self.meta = meta[meta.fold.isin(folds)].reset_index(drop=True)
        self.root = root
        self.train = train
        self.mel = torchaudio.transforms.MelSpectrogram(SR, n_fft=2048, hop_length=512, n_mels=128)
        self.to_db = torchaudio.transforms.AmplitudeToDB(top_db=80)
        self.fmask = torchaudio.transforms.FrequencyMasking(24)
        self.tmask = torchaudio.transforms.TimeMasking(48)

    def __len__(self):
        return len(self.meta)

    def __getitem__(self, i):
        row = self.meta.iloc[i]
        wav, sr = torchaudio.load(os.path.join(self.root, "audio", row.filename))
        if self.train:
            shift = int(torch.randint(-SR // 2, SR // 2, (1,)))
            wav = torch.roll(wav, shift, dims=-1)
            wav = wav * (10 ** (float(torch.empty(1).uniform_(-6, 6)) / 20))
        spec = self.to_db(self.mel(wav))
        if self.train:
            spec = self.tmask(self.fmask(spec))
        spec = (spec + 40.0) / 40.0
        return spec, int(row.target)


class Block(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)

    def forward(self, x):
        x = F.relu(self.b1(self.c1(x)))
        x = F.relu(self.b2(self.c2(x)))
        return F.avg_pool2d(x, 2)


class AudioCNN(L.LightningModule):
    def __init__(self, lr=1e-3, dropout=0.3, mixup=0.2):
        super().__init__()
        self.save_hyperparameters()
        self.features = nn.Sequential(Block(1, 64), Block(64, 128), Block(128, 256), Block(256, 512))
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(512, N_CLASSES)
        self._preds, self._targets = [], []

    def forward(self, x):
        x = self.features(x)
        x = x.mean(dim=2)
        x = x.amax(dim=2) + x.mean(dim=2)
        return self.fc(self.drop(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        lam = float(torch.distributions.Beta(self.hparams.mixup, self.hparams.mixup).sample())
        perm = torch.randperm(x.size(0), device=x.device)
        x = lam * x + (1 - lam) * x[perm]
        logits = self(x)
        loss = lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y[perm])
        self.log("train_loss", loss, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), on_epoch=True, sync_dist=True)
        self._preds.append(logits.argmax(-1))
        self._targets.append(y)

    def on_validation_epoch_end(self):
        preds = self.all_gather(torch.cat(self._preds)).flatten()
        targets = self.all_gather(torch.cat(self._targets)).flatten()
        self._preds.clear()
        self._targets.clear()
        if self.trainer.is_global_zero:
            p, t = preds.cpu().numpy(), targets.cpu().numpy()
            acc = float((p == t).mean())
            f1 = f1_score(t, p, average="macro")
            self.log("val_acc", acc, prog_bar=True, sync_dist=True)
            self.log("val_f1", f1, sync_dist=True)
            if self.current_epoch % 10 == 0 and not self.trainer.sanity_checking:
                self._log_confusion(t, p)

    def _log_confusion(self, t, p):
        cm = confusion_matrix(t, p, labels=list(range(N_CLASSES)))
        fig, ax = plt.subplots(figsize=(10, 10))
        ax.imshow(cm, cmap="Blues")
        ax.set_xlabel("pred")
        ax.set_ylabel("true")
        self.logger.experiment.add_figure("val/confusion", fig, self.current_epoch)
        plt.close(fig)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=1e-2)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.trainer.max_epochs)
        return [opt], [sched]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/ESC-50-master")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=150)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--logdir", default="lightning_logs_esc50")
    args = ap.parse_args()

    L.seed_everything(0)
    train_ds = ESC50(args.root, folds=[1, 2, 3, 4], train=True)
    val_ds = ESC50(args.root, folds=[5], train=False)
    train_dl = DataLoader(train_ds, batch_size=args.bs, shuffle=True, num_workers=args.workers,
                          drop_last=True, pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=args.bs, num_workers=args.workers, pin_memory=True)

    model = AudioCNN(lr=args.lr)
    trainer = L.Trainer(
        accelerator="gpu",
        devices=args.devices,
        strategy="ddp",
        max_epochs=args.epochs,
        precision="16-mixed",
        logger=TensorBoardLogger(args.logdir, name="esc50_cnn"),
        callbacks=[
            ModelCheckpoint(monitor="val_loss", mode="min", save_top_k=2, save_last=True),
            EarlyStopping(monitor="val_loss", patience=30, mode="min"),
        ],
    )
    trainer.fit(model, train_dl, val_dl)


if __name__ == "__main__":
    main()
