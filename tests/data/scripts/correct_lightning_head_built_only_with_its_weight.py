"""The twin of lightning_head_behind_a_zero_loss_weight.py (no finding expected).

The decoder is built only when its weight is above 0, so with the default
weight there is no parameter left without a gradient; a second module keeps
its auxiliary term with weight 0 (every parameter still gets a gradient); a
third gates a head the same way but asks DDP to find unused parameters.
"""

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Denoiser(pl.LightningModule):
    def __init__(self, dim=32, recon_weight=0.0):
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(dim, dim), nn.ReLU())
        self.regressor = nn.Linear(dim, 1)
        self.decoder = nn.Linear(dim, dim) if recon_weight > 0 else None

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.encoder(x)
        loss = F.mse_loss(self.regressor(h).squeeze(-1), y)
        if self.decoder is not None:
            loss = loss + self.hparams.recon_weight * F.mse_loss(self.decoder(h), x)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class WithAuxiliary(pl.LightningModule):
    def __init__(self, dim=32, aux_weight=0.0):
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 1)
        self.aux_head = nn.Linear(dim, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.encoder(x)
        loss = F.mse_loss(self.head(h).squeeze(-1), y)
        aux = F.mse_loss(self.aux_head(h).squeeze(-1), y)
        return loss + self.hparams.aux_weight * aux  # weight 0: a gradient of zeros


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--recon-weight", type=float, default=0.0)
    args = parser.parse_args()
    data = TensorDataset(torch.randn(256, 32), torch.randn(256))
    loader = DataLoader(data, batch_size=32, shuffle=True)
    trainer = pl.Trainer(accelerator="gpu", devices=2, strategy="ddp", max_epochs=2)
    trainer.fit(Denoiser(recon_weight=args.recon_weight), loader)
    trainer.fit(WithAuxiliary(), loader)


if __name__ == "__main__":
    main()
