"""A LightningModule whose validation macro F1 is computed at epoch end from the
predictions each rank's validation_step collected, and logged as it is.

Under DDP (Lightning's default on a machine with several GPUs) each rank
validates its own share, so every rank logs the F1 of a quarter of the data,
and ModelCheckpoint(monitor="val_f1") on rank 0 picks checkpoints on it.
Lint only (Lightning is not installed here).
"""

import lightning as L
import torch
import torch.nn.functional as F
from sklearn.metrics import f1_score


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(16, 4)
        self.predictions, self.targets = [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.predictions.append(self.net(x).argmax(-1).cpu())
        self.targets.append(y.cpu())

    def on_validation_epoch_end(self):
        predicted = torch.cat(self.predictions).numpy()
        expected = torch.cat(self.targets).numpy()
        self.predictions.clear()
        self.targets.clear()
        f1 = f1_score(expected, predicted, average="macro")
        self.log("val_f1", f1, prog_bar=True)  # expect: metrics-not-reduced

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters())


if __name__ == "__main__":
    trainer = L.Trainer(max_epochs=3, callbacks=[L.pytorch.callbacks.ModelCheckpoint(monitor="val_f1")])
