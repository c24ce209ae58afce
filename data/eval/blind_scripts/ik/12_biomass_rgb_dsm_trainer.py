"""Above-ground biomass (t/ha) of winter wheat plots from UAV RGB + canopy height model.

Input is 4 channels: RGB orthophoto crop and the CHM (DSM minus DTM, in m)
resampled to the same grid. The CHM channel gets its own stem so that the
ImageNet RGB weights are kept.

Jobs on the cluster are preempted, so the trainer checkpoints every epoch and
resumes from --resume:

    torchrun --nproc_per_node=4 12_biomass_rgb_dsm_trainer.py --data /data/wheat_agb --resume ckpt/agb/last.pt
"""
import argparse
import logging
import os
import time

import numpy as np
import pandas as pd
import rasterio
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--ckpt-dir", default="ckpt/agb")
    p.add_argument("--resume", default="")
    return p.parse_args()


class PlotRasterDataset(Dataset):
    RGB_MEAN = np.array([0.40, 0.45, 0.33], dtype=np.float32)[:, None, None]
    RGB_STD = np.array([0.17, 0.16, 0.15], dtype=np.float32)[:, None, None]

    def __init__(self, root, split, size, train, agb_mean=None, agb_std=None):
        df = pd.read_csv(os.path.join(root, "plots.csv"))
        self.df = df[df.split == split].reset_index(drop=True)
        self.root = root
        self.size = size
        self.train = train
        self.agb_mean = agb_mean if agb_mean is not None else float(self.df.agb.mean())
        self.agb_std = agb_std if agb_std is not None else float(self.df.agb.std())

    def __len__(self):
        return len(self.df)

    def _read(self, rel):
        with rasterio.open(os.path.join(self.root, rel)) as src:
            return src.read().astype(np.float32)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        rgb = (self._read(r.rgb) / 255.0 - self.RGB_MEAN) / self.RGB_STD
        chm = self._read(r.chm)[:1].clip(0, 1.5) / 1.5
        x = torch.from_numpy(np.concatenate([rgb, chm]))
        x = F.interpolate(x[None], size=(self.size, self.size), mode="bilinear", align_corners=False)[0]
        if self.train:
            if torch.rand(1) < 0.5:
                x = x.flip(-1)
            if torch.rand(1) < 0.5:
                x = x.flip(-2)
            x[:3] = x[:3] * (0.85 + 0.3 * torch.rand(1)) + 0.1 * torch.randn(1)
            x[3:] = x[3:] * (0.95 + 0.1 * torch.rand(1))  # CHM scale error between flights
        y = (r.agb - self.agb_mean) / self.agb_std
        return x, torch.tensor(y, dtype=torch.float32)


class RGBCHMRegressor(nn.Module):
    def __init__(self, arch="convnext_tiny"):
        super().__init__()
        self.rgb = timm.create_model(arch, pretrained=True, num_classes=0)
        self.chm_stem = nn.Sequential(nn.Conv2d(1, 32, 7, 4, 3), nn.GELU(), nn.Conv2d(32, 96, 1))
        self.head = nn.Sequential(nn.LayerNorm(self.rgb.num_features), nn.Linear(self.rgb.num_features, 1))

    def forward(self, x):
        rgb, chm = x[:, :3], x[:, 3:]
        f = self.rgb.stem(rgb) + self.chm_stem(chm)
        f = self.rgb.stages(f)
        f = self.rgb.forward_head(f, pre_logits=True)
        return self.head(f).squeeze(1)


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        logging.basicConfig(level=logging.INFO if self.rank == 0 else logging.ERROR,
                            format=f"[rank{self.rank}] %(asctime)s %(message)s")

        self.train_ds = PlotRasterDataset(args.data, "train", args.size, True)
        self.val_ds = PlotRasterDataset(args.data, "val", args.size, False,
                                        self.train_ds.agb_mean, self.train_ds.agb_std)
        self.sampler = DistributedSampler(self.train_ds, shuffle=True, drop_last=True)
        self.train_loader = DataLoader(self.train_ds, args.batch_size, sampler=self.sampler,
                                       num_workers=args.workers, pin_memory=True, drop_last=True)
        self.val_loader = DataLoader(Subset(self.val_ds, range(self.rank, len(self.val_ds), self.world)),
                                     batch_size=64, num_workers=args.workers)

        self.net = RGBCHMRegressor().to(self.device)
        self.model = DDP(self.net, device_ids=[self.local_rank])
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=args.lr, weight_decay=0.05)
        self.sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(self.opt, T_0=25, eta_min=1e-6)
        self.epoch = 0
        self.best_rmse = float("inf")
        if args.resume and os.path.exists(args.resume):
            self.load(args.resume)

    def load(self, path):
        ckpt = torch.load(path)
        self.net.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["opt"])
        self.sched.load_state_dict(ckpt["sched"])
        self.epoch = ckpt["epoch"] + 1
        self.best_rmse = ckpt["best_rmse"]
        logger.info("resumed from %s at epoch %d", path, self.epoch)

    def save(self, name):
        if self.rank != 0:
            return
        os.makedirs(self.args.ckpt_dir, exist_ok=True)
        torch.save({"model": self.net.state_dict(), "opt": self.opt.state_dict(), "sched": self.sched.state_dict(),
                    "epoch": self.epoch, "best_rmse": self.best_rmse,
                    "agb_norm": (self.train_ds.agb_mean, self.train_ds.agb_std)},
                   os.path.join(self.args.ckpt_dir, name))

    def train_epoch(self):
        self.model.train()
        self.sampler.set_epoch(self.epoch)
        n_iter = len(self.train_loader)
        tot = torch.zeros(2, device=self.device)
        for i, (x, y) in enumerate(self.train_loader):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = self.model(x)
            loss = F.huber_loss(pred.float(), y, delta=1.0)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.sched.step(self.epoch + i / n_iter)
            tot += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=self.device)])
        dist.all_reduce(tot)
        return (tot[0] / tot[1]).item()

    @torch.no_grad()
    def validate(self):
        self.net.eval()
        s = torch.zeros(4, device=self.device, dtype=torch.float64)
        for x, y in self.val_loader:
            x, y = x.to(self.device), y.to(self.device)
            p = self.net(x).double() * self.train_ds.agb_std + self.train_ds.agb_mean
            t = y.double() * self.train_ds.agb_std + self.train_ds.agb_mean
            s += torch.stack([((p - t) ** 2).sum(), t.sum(), (t ** 2).sum(), torch.tensor(len(t), device=self.device,
                                                                                         dtype=torch.float64)])
        dist.all_reduce(s)
        sse, st, st2, n = s.tolist()
        rmse = (sse / n) ** 0.5
        r2 = 1 - sse / max(st2 - st * st / n, 1e-9)
        return rmse, r2

    def fit(self):
        while self.epoch < self.args.epochs:
            t0 = time.time()
            loss = self.train_epoch()
            rmse, r2 = self.validate()
            logger.info("epoch %d loss %.4f val RMSE %.3f t/ha R2 %.3f (%.0fs)", self.epoch, loss, rmse, r2,
                        time.time() - t0)
            if rmse < self.best_rmse:
                self.best_rmse = rmse
                self.save("best.pt")
            self.save("last.pt")
            self.epoch += 1
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    Trainer(parse_args()).fit()
