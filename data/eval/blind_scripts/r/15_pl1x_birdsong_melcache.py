# Bird call classification from 5 s clips (xeno-canto subset, 264 species)
# pytorch-lightning 1.9, DDP on a 4-GPU node:
#   python 15_pl1x_birdsong_melcache.py --data_dir /data/birdclef --cache_dir /data/birdclef/cache --gpus 4
import argparse
import os

import numpy as np
import pandas as pd
import pytorch_lightning as pl
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from pytorch_lightning.callbacks import ModelCheckpoint, LearningRateMonitor
from torch.utils.data import DataLoader, Dataset, TensorDataset

SR = 32000
CLIP = 5 * SR
N_MELS = 128


def wav_to_logmel(path, mel):
    wav, sr = torchaudio.load(path)
    wav = wav.mean(0)
    if sr != SR:
        wav = torchaudio.functional.resample(wav, sr, SR)
    wav = wav[:CLIP] if wav.numel() >= CLIP else F.pad(wav, (0, CLIP - wav.numel()))
    spec = mel(wav)
    return torch.log(spec + 1e-6).half()


class MelAugment(Dataset):
    def __init__(self, feats, labels, train):
        self.feats, self.labels, self.train = feats, labels, train

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = self.feats[i].float()
        if self.train:
            x = torchaudio.transforms.FrequencyMasking(20)(x)
            x = torchaudio.transforms.TimeMasking(40)(x)
            x = torch.roll(x, np.random.randint(0, x.shape[-1]), dims=-1)
        x = (x + 6.0) / 4.0
        return x.unsqueeze(0), self.labels[i]


class BirdDataModule(pl.LightningDataModule):
    def __init__(self, data_dir, cache_dir, batch_size=64, num_workers=8):
        super().__init__()
        self.data_dir, self.cache_dir = data_dir, cache_dir
        self.batch_size, self.num_workers = batch_size, num_workers
        meta = pd.read_csv(os.path.join(data_dir, "train_metadata.csv"))
        self.classes = sorted(meta.primary_label.unique())

    def prepare_data(self):
        if not os.path.exists(os.path.join(self.data_dir, "train_metadata.csv")):
            raise FileNotFoundError("run scripts/download_birdclef.sh first")

    def _features(self, split, df):
        path = os.path.join(self.cache_dir, f"logmel_{split}_{N_MELS}.pt")
        if os.path.exists(path):
            return torch.load(path)
        mel = torchaudio.transforms.MelSpectrogram(SR, n_fft=2048, hop_length=512, n_mels=N_MELS, f_min=50, f_max=14000)
        feats = torch.stack([wav_to_logmel(os.path.join(self.data_dir, "train_audio", f), mel) for f in df.filename])
        labels = torch.tensor([self.classes.index(c) for c in df.primary_label])
        os.makedirs(self.cache_dir, exist_ok=True)
        torch.save((feats, labels), path)
        return feats, labels

    def setup(self, stage=None):
        meta = pd.read_csv(os.path.join(self.data_dir, "train_metadata.csv"))
        val_mask = meta.index % 10 == 0
        tr_f, tr_y = self._features("train", meta[~val_mask])
        va_f, va_y = self._features("val", meta[val_mask])
        self.train_set = MelAugment(tr_f, tr_y, train=True)
        self.val_set = MelAugment(va_f, va_y, train=False)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          num_workers=self.num_workers, pin_memory=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size * 2, num_workers=self.num_workers)


class BirdNet(pl.LightningModule):
    def __init__(self, n_classes, backbone="efficientnet_b0", lr=1e-3, epochs=30):
        super().__init__()
        self.save_hyperparameters()
        self.backbone = timm.create_model(backbone, pretrained=False, in_chans=1, num_classes=n_classes,
                                          drop_rate=0.3)

    def forward(self, x):
        return self.backbone(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y, label_smoothing=0.05)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        correct = (logits.argmax(1) == y).sum()
        return {"loss": F.cross_entropy(logits, y, reduction="sum"), "correct": correct, "n": y.numel()}

    def validation_epoch_end(self, outputs):
        loss = torch.stack([o["loss"] for o in outputs]).sum()
        correct = torch.stack([o["correct"] for o in outputs]).sum()
        n = torch.tensor(float(sum(o["n"] for o in outputs)), device=self.device)
        totals = self.all_gather(torch.stack([loss, correct.float(), n])).reshape(-1, 3).sum(0)
        self.log("val_loss", totals[0] / totals[2], prog_bar=True)
        self.log("val_acc", totals[1] / totals[2], prog_bar=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=1e-2)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.hparams.epochs, eta_min=1e-6)
        return [opt], [sched]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", default="/data/birdclef")
    ap.add_argument("--cache_dir", default="/data/birdclef/cache")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--backbone", default="efficientnet_b0")
    args = ap.parse_args()

    pl.seed_everything(2023)
    dm = BirdDataModule(args.data_dir, args.cache_dir, batch_size=args.batch_size)
    model = BirdNet(len(dm.classes), backbone=args.backbone, lr=args.lr, epochs=args.epochs)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=args.gpus,
        strategy="ddp",
        precision=16,
        max_epochs=args.epochs,
        callbacks=[ModelCheckpoint(monitor="val_acc", mode="max", save_last=True),
                   LearningRateMonitor()],
        default_root_dir="runs/birdclef",
    )
    trainer.fit(model, datamodule=dm)


if __name__ == "__main__":
    main()
