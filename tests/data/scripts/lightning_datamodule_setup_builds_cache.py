"""A LightningDataModule that tokenises its CSV and caches the tensors with
torch.save in setup(), trained on every GPU of the machine. Lightning runs
setup() on every process: on the first run all of them miss the cache and
write it at once, and a rank can torch.load a half-written file (EOFError,
"PytorchStreamReader failed"). prepare_data() runs once per node and is the
place for it."""

import os

import lightning.pytorch as pl
import pandas as pd
import torch
from torch.utils.data import DataLoader, TensorDataset


class ReviewsData(pl.LightningDataModule):
    def __init__(self, csv_path, cache_dir="cache", batch_size=32):
        super().__init__()
        self.csv_path, self.cache_dir, self.batch_size = csv_path, cache_dir, batch_size

    def _encode(self):
        os.makedirs(self.cache_dir, exist_ok=True)
        cache = os.path.join(self.cache_dir, "reviews.pt")
        if os.path.exists(cache):
            return torch.load(cache)
        frame = pd.read_csv(self.csv_path)
        features = torch.tensor(frame.drop(columns=["label"]).values, dtype=torch.float32)
        labels = torch.tensor(frame["label"].values)
        torch.save((features, labels), cache)  # expect: dataset-cache-race
        return features, labels

    def setup(self, stage=None):
        self.train_set = TensorDataset(*self._encode())

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(16, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    trainer = pl.Trainer(accelerator="gpu", devices=-1, strategy="ddp", max_epochs=1)
    trainer.fit(Model(), datamodule=ReviewsData("reviews.csv"))
