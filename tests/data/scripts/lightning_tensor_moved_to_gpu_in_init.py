"""A LightningModule that puts a class-weight tensor on the GPU in __init__,
trained by a Trainer on every GPU of the machine (DDP). Every process builds
the module before Lightning gives it its GPU, so the tensor lands on cuda:0 on
every rank, and Lightning moves parameters and buffers, not plain tensors:
ranks 1+ fail in the loss with "Expected all tensors to be on the same
device"."""

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn


class Classifier(pl.LightningModule):
    def __init__(self, positive_share=0.02):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).cuda()
        weight = (1 - positive_share) / positive_share
        self.pos_weight = torch.tensor([weight]).cuda()  # expect: hardcoded-device
        self.label_smoothing = torch.full((1,), 0.1, device="cuda")  # expect: hardcoded-device

    def training_step(self, batch, batch_idx):
        x, y = batch
        targets = y * (1 - self.label_smoothing) + 0.5 * self.label_smoothing
        loss = F.binary_cross_entropy_with_logits(self.net(x).squeeze(1), targets, pos_weight=self.pos_weight)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=4)
    args = parser.parse_args()
    data = torch.utils.data.TensorDataset(torch.randn(512, 32), torch.randint(0, 2, (512,)).float())
    loader = torch.utils.data.DataLoader(data, batch_size=64, shuffle=True)
    trainer = pl.Trainer(accelerator="gpu", devices=args.gpus, strategy="ddp", max_epochs=2)
    trainer.fit(Classifier(), loader)


if __name__ == "__main__":
    main()
