"""
Classifier + reconstruction decoder on STL-10 (labelled split + unlabelled split),
PyTorch Lightning, 4 GPUs.

The reconstruction loss is switched on after a few warm-up epochs so that the classifier
first learns a reasonable embedding.

    python 13_semi_ae_lightning.py --devices 4 --recon_start_epoch 5
"""
from argparse import ArgumentParser

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from torchmetrics import Accuracy
from torchvision import transforms
from torchvision.datasets import STL10


def conv_block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, padding=1, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class Encoder(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.stages = nn.Sequential(
            conv_block(3, width), nn.MaxPool2d(2),            # 48
            conv_block(width, 2 * width), nn.MaxPool2d(2),    # 24
            conv_block(2 * width, 4 * width), nn.MaxPool2d(2),  # 12
            conv_block(4 * width, 8 * width),
        )

    def forward(self, x):
        return self.stages(x)


class Decoder(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.net = nn.Sequential(
            nn.ConvTranspose2d(8 * width, 4 * width, 2, stride=2), nn.ReLU(inplace=True),
            nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2), nn.ReLU(inplace=True),
            nn.ConvTranspose2d(2 * width, width, 2, stride=2), nn.ReLU(inplace=True),
            nn.Conv2d(width, 3, 3, padding=1),
        )

    def forward(self, z):
        return self.net(z)


class SemiAE(pl.LightningModule):
    def __init__(self, num_classes=10, lr=1e-3, recon_weight=1.0, recon_start_epoch=5, width=64):
        super().__init__()
        self.save_hyperparameters()
        self.encoder = Encoder(width)
        self.decoder = Decoder(width)
        self.head = nn.Linear(8 * width, num_classes)
        self.train_acc = Accuracy(task="multiclass", num_classes=num_classes)
        self.val_acc = Accuracy(task="multiclass", num_classes=num_classes)

    def forward(self, x):
        z = self.encoder(x)
        return self.head(F.adaptive_avg_pool2d(z, 1).flatten(1))

    def training_step(self, batch, batch_idx):
        (x_l, y_l), (x_u, _) = batch["labelled"], batch["unlabelled"]
        z_l = self.encoder(x_l)
        logits = self.head(F.adaptive_avg_pool2d(z_l, 1).flatten(1))
        loss = F.cross_entropy(logits, y_l)
        self.train_acc(logits, y_l)
        self.log("train/ce", loss, sync_dist=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)

        if self.current_epoch >= self.hparams.recon_start_epoch:
            x_all = torch.cat([x_l, x_u])
            recon = self.decoder(self.encoder(x_all))
            recon_loss = F.mse_loss(recon, x_all)
            loss = loss + self.hparams.recon_weight * recon_loss
            self.log("train/recon", recon_loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val/loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val/acc", self.val_acc, on_epoch=True, prog_bar=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=5e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.trainer.max_epochs)
        return [opt], [sched]


class STLData(pl.LightningDataModule):
    def __init__(self, root="./data", batch_size=64, workers=6):
        super().__init__()
        self.root, self.batch_size, self.workers = root, batch_size, workers
        norm = transforms.Normalize((0.4467, 0.4398, 0.4066), (0.2603, 0.2566, 0.2713))
        self.train_tf = transforms.Compose([transforms.RandomCrop(96, padding=8),
                                            transforms.RandomHorizontalFlip(),
                                            transforms.ToTensor(), norm])
        self.test_tf = transforms.Compose([transforms.ToTensor(), norm])

    def prepare_data(self):
        # called on local rank 0 only
        STL10(self.root, split="train", download=True)
        STL10(self.root, split="unlabeled", download=True)
        STL10(self.root, split="test", download=True)

    def setup(self, stage=None):
        self.labelled = STL10(self.root, split="train", transform=self.train_tf)
        self.unlabelled = STL10(self.root, split="unlabeled", transform=self.train_tf)
        self.test = STL10(self.root, split="test", transform=self.test_tf)

    def train_dataloader(self):
        return {
            "labelled": DataLoader(self.labelled, batch_size=self.batch_size, shuffle=True,
                                   num_workers=self.workers, drop_last=True),
            "unlabelled": DataLoader(self.unlabelled, batch_size=self.batch_size, shuffle=True,
                                     num_workers=self.workers, drop_last=True),
        }

    def val_dataloader(self):
        return DataLoader(self.test, batch_size=256, num_workers=self.workers)


def main():
    parser = ArgumentParser()
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--recon_start_epoch", type=int, default=5)
    parser.add_argument("--recon_weight", type=float, default=1.0)
    args = parser.parse_args()

    pl.seed_everything(0)
    dm = STLData(batch_size=args.batch_size)
    model = SemiAE(lr=args.lr, recon_weight=args.recon_weight, recon_start_epoch=args.recon_start_epoch)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=args.devices,
        strategy="ddp",
        sync_batchnorm=True,
        max_epochs=args.epochs,
        precision="bf16-mixed",
        logger=CSVLogger("logs", name="semi_ae"),
        callbacks=[ModelCheckpoint(monitor="val/acc", mode="max", save_last=True)],
    )
    trainer.fit(model, datamodule=dm)


if __name__ == "__main__":
    main()
