"""A LightningModule whose reconstruction head only runs when --recon-weight is
above 0, its default 0.0, trained with strategy="ddp".

With the default the decoder never takes part in the loss: its parameters get
no gradient, and Lightning's "ddp" strategy (DDP with
find_unused_parameters=False) fails at the second step with "Expected to have
finished reduction in the prior iteration before starting a new one".
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
        self.decoder = nn.Linear(dim, dim)

    def _step(self, batch):
        x, y = batch
        h = self.encoder(x)
        loss = F.mse_loss(self.regressor(h).squeeze(-1), y)
        if self.hparams.recon_weight > 0:  # expect: unused-parameters
            loss = loss + self.hparams.recon_weight * F.mse_loss(self.decoder(h), x)
        return loss

    def training_step(self, batch, batch_idx):
        return self._step(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self._step(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--recon-weight", type=float, default=0.0)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    data = TensorDataset(torch.randn(256, 32), torch.randn(256))
    model = Denoiser(recon_weight=args.recon_weight)
    trainer = pl.Trainer(accelerator="gpu", devices=args.devices, strategy="ddp", max_epochs=2)
    trainer.fit(model, DataLoader(data, batch_size=32, shuffle=True))


if __name__ == "__main__":
    main()
