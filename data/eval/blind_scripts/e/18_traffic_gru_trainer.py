"""
Traffic speed forecasting (METR-LA style: 207 sensors, 5-min steps, 12 in -> 12 out)
with a GRU encoder-decoder over all sensors at once.

Runs on one GPU or under torchrun:
    python 18_traffic_gru_trainer.py --data data/metr_la.npz
    torchrun --nproc_per_node=4 18_traffic_gru_trainer.py --data data/metr_la.npz
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/metr_la.npz")
    ap.add_argument("--in_len", type=int, default=12)
    ap.add_argument("--out_len", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch_size", type=int, default=64, help="per process")
    ap.add_argument("--lr", type=float, default=1e-3, help="single-process lr; scaled by world size")
    ap.add_argument("--patience", type=int, default=10)
    ap.add_argument("--out_dir", default="runs/traffic_gru")
    ap.add_argument("--resume", default="")
    return ap.parse_args()


class WindowDataset(Dataset):
    def __init__(self, series, in_len, out_len):
        self.s = torch.from_numpy(series.astype(np.float32))  # (T, N)
        self.in_len, self.out_len = in_len, out_len

    def __len__(self):
        return len(self.s) - self.in_len - self.out_len + 1

    def __getitem__(self, i):
        return self.s[i:i + self.in_len], self.s[i + self.in_len:i + self.in_len + self.out_len]


class GRUSeq2Seq(nn.Module):
    def __init__(self, n_nodes, hidden, out_len):
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(n_nodes, hidden), nn.LayerNorm(hidden))
        self.enc = nn.GRU(hidden, hidden, num_layers=2, batch_first=True, dropout=0.1)
        self.dec = nn.GRUCell(n_nodes, hidden)
        self.out = nn.Linear(hidden, n_nodes)
        self.out_len = out_len

    def forward(self, x):
        _, h = self.enc(self.inp(x))
        h = h[-1]
        y_prev = x[:, -1]
        preds = []
        for _ in range(self.out_len):
            h = self.dec(y_prev, h)
            y_prev = self.out(h)
            preds.append(y_prev)
        return torch.stack(preds, 1)


def masked_mae(pred, true, null_val=0.0):
    mask = (true != null_val).float()
    mask = mask / mask.mean().clamp(min=1e-6)
    return (torch.abs(pred - true) * mask).mean()


class Trainer:
    def __init__(self, args):
        self.args = args
        self.distributed = "LOCAL_RANK" in os.environ
        if self.distributed:
            self.local_rank = int(os.environ["LOCAL_RANK"])
            torch.cuda.set_device(self.local_rank)
            dist.init_process_group("nccl")
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        else:
            self.local_rank, self.rank, self.world = 0, 0, 1
        self.device = torch.device("cuda", self.local_rank)
        self.is_main = self.rank == 0
        torch.manual_seed(0)

        d = np.load(args.data)
        speed = d["speed"]                                   # (T, N), 0 = missing
        n_tr, n_va = int(0.7 * len(speed)), int(0.1 * len(speed))
        train = speed[:n_tr]
        self.mean, self.std = train[train > 0].mean(), train[train > 0].std()
        norm = lambda a: np.where(a > 0, (a - self.mean) / self.std, 0.0)
        self.train_ds = WindowDataset(norm(speed[:n_tr]), args.in_len, args.out_len)
        self.val_ds = WindowDataset(norm(speed[n_tr:n_tr + n_va]), args.in_len, args.out_len)

        self.sampler = DistributedSampler(self.train_ds, shuffle=True) if self.distributed else None
        self.train_dl = DataLoader(self.train_ds, batch_size=args.batch_size, sampler=self.sampler,
                                   shuffle=self.sampler is None, num_workers=4, pin_memory=True, drop_last=True)
        self.val_dl = DataLoader(self.val_ds, batch_size=256, shuffle=False, num_workers=2)

        model = GRUSeq2Seq(speed.shape[1], args.hidden, args.out_len).to(self.device)
        self.model = DDP(model, device_ids=[self.local_rank]) if self.distributed else model
        self.lr = args.lr * self.world
        self.opt = torch.optim.Adam(self.model.parameters(), lr=self.lr, eps=1e-8)
        self.sched = torch.optim.lr_scheduler.MultiStepLR(self.opt, milestones=[20, 40, 50], gamma=0.3)
        self.start_epoch, self.best = 0, float("inf")
        if args.resume:
            self._load(args.resume)

    @property
    def raw_model(self):
        return self.model.module if isinstance(self.model, DDP) else self.model

    def _load(self, path):
        ckpt = torch.load(path, map_location=self.device)
        self.raw_model.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["opt"])
        self.sched.load_state_dict(ckpt["sched"])
        self.start_epoch, self.best = ckpt["epoch"] + 1, ckpt["best"]

    def _save(self, epoch, name):
        torch.save({"model": self.raw_model.state_dict(), "opt": self.opt.state_dict(),
                    "sched": self.sched.state_dict(), "epoch": epoch, "best": self.best,
                    "mean": float(self.mean), "std": float(self.std)},
                   os.path.join(self.args.out_dir, name))

    def train_epoch(self, epoch):
        self.model.train()
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)
        total = torch.zeros(2, device=self.device)
        for x, y in tqdm(self.train_dl, disable=not self.is_main, leave=False):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            pred = self.model(x)
            loss = masked_mae(pred * self.std + self.mean, y * self.std + self.mean)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), 5.0)
            self.opt.step()
            total += torch.stack([loss.detach(), torch.ones((), device=self.device)])
        if self.distributed:
            dist.all_reduce(total)
        return (total[0] / total[1]).item()

    @torch.no_grad()
    def validate(self):
        model = self.raw_model
        model.eval()
        err, n = 0.0, 0
        for x, y in self.val_dl:
            x, y = x.to(self.device), y.to(self.device)
            pred = model(x) * self.std + self.mean
            true = y * self.std + self.mean
            mask = y != 0
            err += (pred - true).abs()[mask].sum().item()
            n += mask.sum().item()
        return err / max(n, 1)

    def fit(self):
        if self.is_main:
            os.makedirs(self.args.out_dir, exist_ok=True)
            with open(os.path.join(self.args.out_dir, "args.json"), "w") as f:
                json.dump(vars(self.args), f, indent=2)
        bad_epochs = 0
        for epoch in range(self.start_epoch, self.args.epochs):
            t0 = time.time()
            train_mae = self.train_epoch(epoch)
            self.sched.step()
            stop = torch.zeros(1, device=self.device)
            if self.is_main:
                val_mae = self.validate()
                print(f"epoch {epoch:03d} train MAE {train_mae:.3f} val MAE {val_mae:.3f} ({time.time() - t0:.0f}s)")
                if val_mae < self.best:
                    self.best, bad_epochs = val_mae, 0
                    self._save(epoch, "best.pt")
                else:
                    bad_epochs += 1
                self._save(epoch, "last.pt")
                stop[0] = float(bad_epochs >= self.args.patience)
            if self.distributed:
                dist.broadcast(stop, src=0)
            if stop.item():
                if self.is_main:
                    print("early stopping")
                break
        if self.distributed:
            dist.destroy_process_group()


if __name__ == "__main__":
    Trainer(get_args()).fit()
