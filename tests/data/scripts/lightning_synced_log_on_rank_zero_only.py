"""A LightningModule that logs its epoch metric with sync_dist=True, but only
on rank 0 (to print it there too). sync_dist all-reduces the value over every
rank: rank 0 waits for ranks that never call it, and the end of the first
validation epoch hangs until the collective times out."""

import lightning.pytorch as pl
import torch
from torch import nn


class Forecaster(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.GRU(8, 32, batch_first=True)
        self.head = nn.Linear(32, 1)
        self.errors = []

    def forward(self, x):
        out, _ = self.net(x)
        return self.head(out[:, -1])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.errors.append((self(x) - y).abs().mean().detach())

    def on_validation_epoch_end(self):
        mae = torch.stack(self.errors).mean()
        self.errors.clear()
        if self.trainer.is_global_zero:
            self.log("val/mae", mae, sync_dist=True)  # expect: experiment-logger-ddp
            print(f"epoch {self.current_epoch} mae {mae.item():.4f}")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    trainer = pl.Trainer(accelerator="gpu", devices=4, strategy="ddp", max_epochs=5)
    trainer.fit(Forecaster())
