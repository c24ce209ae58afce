"""Basenji-style sequence-to-coverage model: 131 kb of DNA -> binned CAGE/DNase tracks.

Data: HDF5 with `seqs` (N, 131072, 4) uint8 one-hot and `targets` (N, 1024, T) float16,
written by our make_tfr_h5.py from the Basenji human training windows.

torchrun --nproc_per_node=8 02_dna_dilated_cnn.py --config configs/seq2cov_human.yaml
"""
import argparse
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


class H5Windows(Dataset):
    def __init__(self, path, augment=False, max_shift=3):
        self.path = path
        self.augment = augment
        self.max_shift = max_shift
        self._h5 = None
        with h5py.File(path, "r") as f:
            self.n = f["seqs"].shape[0]

    def _open(self):
        if self._h5 is None:
            self._h5 = h5py.File(self.path, "r")
        return self._h5

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        f = self._open()
        x = torch.from_numpy(f["seqs"][i].astype(np.float32))      # (L, 4)
        y = torch.from_numpy(f["targets"][i].astype(np.float32))   # (bins, T)
        if self.augment:
            shift = np.random.randint(-self.max_shift, self.max_shift + 1)
            if shift != 0:
                x = torch.roll(x, shift, dims=0)
                if shift > 0:
                    x[:shift] = 0.25
                else:
                    x[shift:] = 0.25
            if np.random.rand() < 0.5:
                x = x.flip(0).flip(1)   # reverse complement (ACGT order)
                y = y.flip(0)
        return x.t().contiguous(), y


class ConvBlock(nn.Module):
    def __init__(self, c_in, c_out, k, dilation=1, pool=1, dropout=0.0):
        super().__init__()
        self.bn = nn.BatchNorm1d(c_in, momentum=0.1)
        self.conv = nn.Conv1d(c_in, c_out, k, padding=dilation * (k // 2), dilation=dilation, bias=False)
        self.drop = nn.Dropout(dropout)
        self.pool = nn.MaxPool1d(pool) if pool > 1 else nn.Identity()

    def forward(self, x):
        return self.pool(self.drop(self.conv(F.gelu(self.bn(x)))))


class DilatedResidual(nn.Module):
    def __init__(self, c, n_layers, rate=1.5, dropout=0.3):
        super().__init__()
        self.blocks = nn.ModuleList()
        d = 1.0
        for _ in range(n_layers):
            self.blocks.append(nn.Sequential(
                ConvBlock(c, c // 2, 3, dilation=int(round(d))),
                ConvBlock(c // 2, c, 1, dropout=dropout),
            ))
            d *= rate

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


class Seq2Cov(nn.Module):
    def __init__(self, n_tracks, c0=288, c_tower=768, n_tower=6, n_dil=11):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(4, c0, 15, padding=7), nn.MaxPool1d(2))
        tower, c = [], c0
        for i in range(n_tower):
            c_next = int(round(c0 * (c_tower / c0) ** ((i + 1) / n_tower)))
            tower.append(ConvBlock(c, c_next, 5, pool=2))
            c = c_next
        self.tower = nn.Sequential(*tower)          # 131072 / 2^7 = 1024 bins of 128 bp
        self.dilated = DilatedResidual(c, n_dil)
        self.final = ConvBlock(c, 2 * c, 1, dropout=0.05)
        self.head = nn.Conv1d(2 * c, n_tracks, 1)

    def forward(self, x):
        x = self.stem(x)
        x = self.tower(x)
        x = self.dilated(x)
        x = self.final(x)
        return F.softplus(self.head(x)).transpose(1, 2)   # (B, bins, T)


def poisson_loss(pred, target):
    return (pred - target * torch.log(pred + 1e-6)).mean()


@torch.no_grad()
def evaluate(model, loader, device, n_tracks):
    model.eval()
    # per-track sufficient statistics for Pearson R
    s = torch.zeros(6, n_tracks, dtype=torch.float64, device=device)
    loss_sum = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            p = model(x)
        p = p.float()
        loss_sum[0] += poisson_loss(p, y).double() * x.size(0)
        loss_sum[1] += x.size(0)
        p, y = p.reshape(-1, n_tracks).double(), y.reshape(-1, n_tracks).double()
        s[0] += p.sum(0); s[1] += y.sum(0)
        s[2] += (p * p).sum(0); s[3] += (y * y).sum(0)
        s[4] += (p * y).sum(0); s[5] += p.size(0)
    dist.all_reduce(s)
    dist.all_reduce(loss_sum)
    n = s[5]
    cov = s[4] / n - (s[0] / n) * (s[1] / n)
    var_p = s[2] / n - (s[0] / n) ** 2
    var_y = s[3] / n - (s[1] / n) ** 2
    r = cov / torch.sqrt(var_p * var_y).clamp_min(1e-12)
    model.train()
    return (loss_sum[0] / loss_sum[1]).item(), r.mean().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    with open(args.config) as fh:
        cfg = yaml.safe_load(fh)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg.get("seed", 42))

    train_ds = H5Windows(cfg["train_h5"], augment=True)
    valid_full = H5Windows(cfg["valid_h5"])
    valid_ds = Subset(valid_full, list(range(rank, len(valid_full), world)))

    # 131 kb windows: only two fit per GPU
    batch_size = cfg.get("batch_size", 2)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=batch_size, sampler=train_sampler,
                              num_workers=6, pin_memory=True, persistent_workers=True)
    valid_loader = DataLoader(valid_ds, batch_size=batch_size, num_workers=4, pin_memory=True)

    n_tracks = cfg["n_tracks"]
    model = Seq2Cov(n_tracks).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    opt = torch.optim.Adam(model.parameters(), lr=cfg.get("lr", 1e-4), betas=(0.9, 0.999))
    clip = cfg.get("clip_norm", 2.0)
    out_dir = cfg["out_dir"]
    writer = None
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(out_dir, "tb"))

    start_epoch, best_r, step = 0, -1.0, 0
    last = os.path.join(out_dir, "last.pt")
    if os.path.exists(last):
        ck = torch.load(last, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start_epoch, best_r, step = ck["epoch"] + 1, ck["best_r"], ck["step"]

    patience, bad_epochs = cfg.get("patience", 10), 0
    for epoch in range(start_epoch, cfg.get("epochs", 100)):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x)
            loss = poisson_loss(pred.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/grad_norm", gn.item(), step)

        val_loss, val_r = evaluate(model.module, valid_loader, device, n_tracks)
        improved = val_r > best_r
        if improved:
            best_r, bad_epochs = val_r, 0
        else:
            bad_epochs += 1
        if rank == 0:
            print(f"epoch {epoch} valid poisson {val_loss:.4f} pearsonR {val_r:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            writer.add_scalar("valid/loss", val_loss, epoch)
            writer.add_scalar("valid/pearsonR", val_r, epoch)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                     "epoch": epoch, "best_r": best_r, "step": step, "cfg": cfg}
            torch.save(state, last + ".tmp")
            os.replace(last + ".tmp", last)
            if improved:
                torch.save(model.module.state_dict(), os.path.join(out_dir, "best_model.pt"))
        dist.barrier()
        if bad_epochs >= patience:
            break

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
