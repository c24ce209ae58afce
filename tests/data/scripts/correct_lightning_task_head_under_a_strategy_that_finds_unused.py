"""Class-incremental learning on Lightning: every task's head is built at the
start, and each training step runs the head of the task being learned, under
a strategy that finds the heads a step leaves out (DDP's
find_unused_parameters=True)."""

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn


class Incremental(pl.LightningModule):
    def __init__(self, tasks=5, classes_per_task=2):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(32, 64), nn.ReLU())
        self.heads = nn.ModuleList(nn.Linear(64, classes_per_task) for _ in range(tasks))
        self.current_task = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.heads[self.current_task](self.backbone(x))
        loss = F.cross_entropy(logits, y)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main():
    model = Incremental()
    for task in range(5):
        model.current_task = task
        data = torch.utils.data.TensorDataset(torch.randn(256, 32), torch.randint(0, 2, (256,)))
        trainer = pl.Trainer(devices=2, strategy="ddp_find_unused_parameters_true", max_epochs=1)
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=32))


if __name__ == "__main__":
    main()
