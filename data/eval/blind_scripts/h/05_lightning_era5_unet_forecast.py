"""
Regional 2 m temperature / precipitation forecaster (UNet) on ERA5 crops over
Central Europe, trained with Lightning DDP on 2 nodes x 4 GPUs.

    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=4
    #SBATCH --gpus-per-node=4
    srun python 05_lightning_era5_unet_forecast.py --data-dir /scratch/era5_ce --nodes 2 --gpus 4

Lightning picks up the SLURM environment (SLURMEnvironment), so no torchrun here.
"""
import argparse
import json
import os

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from torch.utils.data import DataLoader, Dataset
from torchmetrics import Metric

CHANNELS = ["t2m", "tp", "msl", "u10", "v10", "z500", "t850"]
TARGETS = [0, 1]


class Era5Crops(Dataset):
    def __init__(self, files, stats, lead=4):
        self.data = [np.load(f, mmap_mode="r") for f in files]          # (T, C, H, W)
        self.index = [(i, t) for i, d in enumerate(self.data) for t in range(d.shape[0] - lead)]
        self.mean = np.asarray(stats["mean"], dtype=np.float32)[:, None, None]
        self.std = np.asarray(stats["std"], dtype=np.float32)[:, None, None]
        self.lead = lead

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k):
        i, t = self.index[k]
        x = (np.asarray(self.data[i][t], dtype=np.float32) - self.mean) / self.std
        y = (np.asarray(self.data[i][t + self.lead], dtype=np.float32) - self.mean) / self.std
        return torch.from_numpy(x), torch.from_numpy(y[TARGETS])


class Era5DataModule(pl.LightningDataModule):
    def __init__(self, data_dir, batch_size=16, num_workers=8):
        super().__init__()
        self.data_dir, self.batch_size, self.num_workers = data_dir, batch_size, num_workers
        self.stats_path = os.path.join(data_dir, "norm_stats.json")
        # shared scratch file system: compute the stats once, on global rank 0 only
        self.prepare_data_per_node = False

    def _files(self, years):
        return [os.path.join(self.data_dir, f"era5_ce_{y}.npy") for y in years]

    def prepare_data(self):
        # runs on global rank 0 only; Lightning holds the other ranks in a barrier
        if os.path.exists(self.stats_path):
            return
        acc = [np.load(f, mmap_mode="r")[::24] for f in self._files(range(1979, 2016))]
        stack = np.concatenate(acc).astype(np.float64)
        stats = {"mean": stack.mean(axis=(0, 2, 3)).tolist(), "std": stack.std(axis=(0, 2, 3)).tolist()}
        tmp = self.stats_path + f".tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(stats, f)
        os.replace(tmp, self.stats_path)

    def setup(self, stage=None):
        with open(self.stats_path) as f:
            stats = json.load(f)
        self.train_ds = Era5Crops(self._files(range(1979, 2016)), stats)
        self.val_ds = Era5Crops(self._files(range(2016, 2018)), stats)
        self.test_ds = Era5Crops(self._files(range(2018, 2020)), stats)

    def _loader(self, ds, shuffle):
        # Lightning replaces the sampler with a DistributedSampler (use_distributed_sampler=True)
        return DataLoader(ds, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers,
                          pin_memory=True, persistent_workers=True, drop_last=shuffle)

    def train_dataloader(self):
        return self._loader(self.train_ds, True)

    def val_dataloader(self):
        return self._loader(self.val_ds, False)

    def test_dataloader(self):
        return self._loader(self.test_ds, False)


class WeightedRMSE(Metric):
    """Per-channel RMSE; sums are all-reduced by torchmetrics at compute()."""

    def __init__(self, n_channels):
        super().__init__()
        self.add_state("sse", default=torch.zeros(n_channels), dist_reduce_fx="sum")
        self.add_state("n", default=torch.zeros(()), dist_reduce_fx="sum")

    def update(self, pred, target):
        self.sse += ((pred - target) ** 2).mean(dim=(2, 3)).sum(dim=0)
        self.n += pred.shape[0]

    def compute(self):
        return torch.sqrt(self.sse / self.n)


def conv_block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.GELU(),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.GELU())


class UNet(nn.Module):
    def __init__(self, cin, cout, width=64):
        super().__init__()
        w = [width, width * 2, width * 4, width * 8]
        self.enc = nn.ModuleList([conv_block(cin, w[0]), conv_block(w[0], w[1]),
                                  conv_block(w[1], w[2]), conv_block(w[2], w[3])])
        self.up = nn.ModuleList([nn.ConvTranspose2d(w[i], w[i - 1], 2, stride=2) for i in (3, 2, 1)])
        self.dec = nn.ModuleList([conv_block(w[i], w[i - 1]) for i in (3, 2, 1)])
        self.out = nn.Conv2d(w[0], cout, 1)

    def forward(self, x):
        skips = []
        for i, blk in enumerate(self.enc):
            x = blk(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips[:-1])):
            x = dec(torch.cat([up(x), skip], dim=1))
        return self.out(x)


class Forecaster(pl.LightningModule):
    def __init__(self, lr=3e-4, width=64, warmup_epochs=2):
        super().__init__()
        self.save_hyperparameters()
        self.net = UNet(len(CHANNELS), len(TARGETS), width)
        self.val_rmse = WeightedRMSE(len(TARGETS))
        self.test_rmse = WeightedRMSE(len(TARGETS))
        self._example = None

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        pred = self(x)
        self.val_rmse.update(pred, y)
        self.log("val/loss", F.mse_loss(pred, y), on_epoch=True, sync_dist=True)
        if batch_idx == 0 and self.trainer.is_global_zero:
            self._example = (y[0].float().cpu(), pred[0].float().cpu())

    def on_validation_epoch_end(self):
        rmse = self.val_rmse.compute()
        self.log("val/rmse_t2m", rmse[0])
        self.log("val/rmse_tp", rmse[1])
        self.val_rmse.reset()
        if self.trainer.is_global_zero and self._example is not None:
            self._log_example()

    @rank_zero_only
    def _log_example(self):
        import matplotlib.pyplot as plt
        y, p = self._example
        fig, ax = plt.subplots(1, 2, figsize=(8, 3))
        ax[0].imshow(y[0], cmap="coolwarm"); ax[0].set_title("ERA5 t2m")
        ax[1].imshow(p[0], cmap="coolwarm"); ax[1].set_title("UNet t2m")
        self.logger.log_image("val/example", [fig], step=self.global_step)
        plt.close(fig)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.test_rmse.update(self(x), y)

    def on_test_epoch_end(self):
        rmse = self.test_rmse.compute()
        self.log_dict({"test/rmse_t2m": rmse[0], "test/rmse_tp": rmse[1]})
        self.test_rmse.reset()

    def configure_optimizers(self):
        lr = self.hparams.lr * self.trainer.world_size ** 0.5
        opt = torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.05)
        warm = self.hparams.warmup_epochs
        sched = torch.optim.lr_scheduler.SequentialLR(opt, [
            torch.optim.lr_scheduler.LinearLR(opt, 0.01, 1.0, total_iters=warm),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.trainer.max_epochs - warm)],
            milestones=[warm])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--ckpt-dir", default="checkpoints/unet_ce")
    args = ap.parse_args()

    pl.seed_everything(17, workers=True)
    dm = Era5DataModule(args.data_dir, args.batch_size)
    model = Forecaster(lr=args.lr)
    logger = WandbLogger(project="era5-ce-unet", log_model=False)
    ckpt = ModelCheckpoint(dirpath=args.ckpt_dir, monitor="val/rmse_t2m", mode="min", save_top_k=3, save_last=True)
    trainer = pl.Trainer(
        accelerator="gpu", devices=args.gpus, num_nodes=args.nodes,
        strategy=DDPStrategy(find_unused_parameters=False, gradient_as_bucket_view=True),
        precision="bf16-mixed", sync_batchnorm=True, max_epochs=args.epochs,
        logger=logger, callbacks=[ckpt, LearningRateMonitor("epoch")],
        gradient_clip_val=1.0, log_every_n_steps=50,
    )
    rank_zero_info(f"world size {trainer.world_size}, per-GPU batch {args.batch_size}")
    trainer.fit(model, datamodule=dm, ckpt_path="last" if os.path.exists(os.path.join(args.ckpt_dir, "last.ckpt")) else None)
    trainer.test(model, datamodule=dm, ckpt_path="best")


if __name__ == "__main__":
    main()
