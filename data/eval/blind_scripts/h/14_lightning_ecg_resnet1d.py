"""
12-lead ECG rhythm classification (PTB-XL, 5 superclasses: NORM/MI/STTC/CD/HYP) with a
1D ResNet, PyTorch Lightning, DDP on one node.

    python 14_lightning_ecg_resnet1d.py --data /data/ptbxl_500hz.npz --devices 4

Lightning starts the other three ranks itself (strategy="ddp").
"""
import argparse

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from sklearn.metrics import f1_score, roc_auc_score
from torch.utils.data import DataLoader, Dataset

CLASSES = ["NORM", "MI", "STTC", "CD", "HYP"]


class ECGDataset(Dataset):
    def __init__(self, x, y, train=False):
        self.x, self.y, self.train = x, y, train

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        sig = self.x[i].astype(np.float32)                            # 12 x 5000
        if self.train:
            start = np.random.randint(0, sig.shape[1] - 4000 + 1)
            sig = sig[:, start:start + 4000]
            sig = sig * np.random.uniform(0.9, 1.1) + np.random.normal(0, 0.01, sig.shape).astype(np.float32)
        else:
            sig = sig[:, 500:4500]
        return torch.from_numpy(sig), torch.from_numpy(self.y[i].astype(np.float32))


class PTBXLDataModule(pl.LightningDataModule):
    def __init__(self, path, batch_size=64, workers=6):
        super().__init__()
        self.path, self.batch_size, self.workers = path, batch_size, workers

    def setup(self, stage=None):
        z = np.load(self.path)
        x, y, fold = z["signals"], z["labels"], z["strat_fold"]
        mu, sd = x[fold <= 8].mean(axis=(0, 2), keepdims=True), x[fold <= 8].std(axis=(0, 2), keepdims=True)
        x = (x - mu) / (sd + 1e-6)
        self.train_ds = ECGDataset(x[fold <= 8], y[fold <= 8], train=True)
        self.val_ds = ECGDataset(x[fold == 9], y[fold == 9])
        self.test_ds = ECGDataset(x[fold == 10], y[fold == 10])

    def train_dataloader(self):
        return DataLoader(self.train_ds, self.batch_size, shuffle=True, num_workers=self.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)

    def val_dataloader(self):
        return DataLoader(self.val_ds, self.batch_size, shuffle=False, num_workers=self.workers)

    def test_dataloader(self):
        return DataLoader(self.test_ds, self.batch_size, shuffle=False, num_workers=self.workers)


class BasicBlock1d(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv1d(cin, cout, 15, stride, padding=7, bias=False)
        self.bn1 = nn.BatchNorm1d(cout)
        self.conv2 = nn.Conv1d(cout, cout, 15, 1, padding=7, bias=False)
        self.bn2 = nn.BatchNorm1d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv1d(cin, cout, 1, stride, bias=False), nn.BatchNorm1d(cout))

    def forward(self, x):
        idt = x if self.down is None else self.down(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + idt)


class ResNet1d(nn.Module):
    def __init__(self, n_leads=12, n_classes=5, widths=(64, 128, 196, 256)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(n_leads, widths[0], 15, 2, padding=7, bias=False),
                                  nn.BatchNorm1d(widths[0]), nn.ReLU(), nn.MaxPool1d(3, 2, 1))
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            blocks += [BasicBlock1d(cin, w, stride=1 if i == 0 else 2), BasicBlock1d(w, w)]
            cin = w
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(2 * cin, n_classes)

    def forward(self, x):
        h = self.blocks(self.stem(x))
        return self.fc(torch.cat([h.mean(-1), h.amax(-1)], dim=1))


class ECGClassifier(pl.LightningModule):
    def __init__(self, lr=1e-3, weight_decay=1e-2, epochs=50):
        super().__init__()
        self.save_hyperparameters()
        self.net = ResNet1d()
        self._val_probs, self._val_targets = [], []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.binary_cross_entropy_with_logits(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.binary_cross_entropy_with_logits(logits, y), on_epoch=True, sync_dist=True)
        self._val_probs.append(torch.sigmoid(logits).float().cpu())
        self._val_targets.append(y.cpu())

    def on_validation_epoch_end(self):
        probs = torch.cat(self._val_probs).numpy()
        targets = torch.cat(self._val_targets).numpy().astype(int)
        self._val_probs.clear(); self._val_targets.clear()
        f1 = f1_score(targets, probs > 0.5, average="macro", zero_division=0)
        try:
            auc = roc_auc_score(targets, probs, average="macro")
        except ValueError:
            auc = float("nan")
        self.log("val_macro_f1", f1, prog_bar=True)
        self.log("val_macro_auc", auc, prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.binary_cross_entropy_with_logits(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.hparams.lr,
                                                    total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()

    pl.seed_everything(2024, workers=True)
    dm = PTBXLDataModule(args.data, args.batch_size)
    model = ECGClassifier(lr=args.lr * args.devices, epochs=args.epochs)
    callbacks = [
        ModelCheckpoint(dirpath="ckpt/ecg_resnet1d", monitor="val_macro_f1", mode="max", save_top_k=2,
                        filename="{epoch:02d}-{val_macro_f1:.4f}"),
        EarlyStopping(monitor="val_macro_f1", mode="max", patience=8),
        LearningRateMonitor("step"),
    ]
    trainer = pl.Trainer(accelerator="gpu", devices=args.devices, strategy="ddp", sync_batchnorm=True,
                         precision="16-mixed", max_epochs=args.epochs, callbacks=callbacks,
                         logger=CSVLogger("logs", name="ecg_resnet1d"), deterministic=False)
    trainer.fit(model, datamodule=dm)
    trainer.test(model, datamodule=dm, ckpt_path="best")


if __name__ == "__main__":
    main()
