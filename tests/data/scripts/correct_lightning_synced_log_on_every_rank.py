"""The LightningModule of lightning_synced_log_on_rank_zero_only.py with the fix:
every rank logs the metric with sync_dist=True (each reaches the all-reduce),
and only the print stays on rank 0."""

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
        self.log("val/mae", mae, sync_dist=True)
        if self.trainer.is_global_zero:
            print(f"epoch {self.current_epoch} mae {mae.item():.4f}")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    trainer = pl.Trainer(accelerator="gpu", devices=4, strategy="ddp", max_epochs=5)
    trainer.fit(Forecaster())
