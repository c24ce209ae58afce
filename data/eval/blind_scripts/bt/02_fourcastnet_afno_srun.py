"""FourCastNet-style AFNO emulator trained on ERA5 (0.25 deg, 6-hourly).

Launched directly by Slurm, one task per GPU (see jobs/afno_era5.sbatch):

    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_PORT=29511
    srun --nodes=4 --ntasks-per-node=4 --gpus-per-node=4 --cpus-per-task=8 \
        python 02_fourcastnet_afno_srun.py --exp-dir $SCRATCH/afno/run01

Data layout: one HDF5 file per year, dataset "fields" of shape (T, C, 721, 1440);
statistics (global_means.npy / global_stds.npy) were computed offline from 1979-2015.
"""
import argparse
import os
import signal
import subprocess
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

CHANNELS = ["u10", "v10", "t2m", "sp", "msl", "t850", "u1000", "v1000", "z1000", "u850",
            "v850", "z850", "u500", "v500", "z500", "t500", "z50", "r500", "r850", "tcwv"]
Z500, T2M = CHANNELS.index("z500"), CHANNELS.index("t2m")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="/lustre/shared/era5_h5")
    p.add_argument("--stats-dir", default="/lustre/shared/era5_h5/stats")
    p.add_argument("--train-years", default="1979-2015")
    p.add_argument("--valid-years", default="2016-2017")
    p.add_argument("--exp-dir", required=True)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--patch", type=int, default=8)
    p.add_argument("--embed-dim", type=int, default=768)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--val-steps", type=int, default=4, help="6h steps in the validation rollout")
    p.add_argument("--val-samples", type=int, default=128)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


def year_range(s):
    a, b = s.split("-")
    return list(range(int(a), int(b) + 1))


def setup_distributed():
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    if "MASTER_ADDR" not in os.environ:
        hosts = subprocess.check_output(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]])
        os.environ["MASTER_ADDR"] = hosts.decode().split()[0]
    os.environ.setdefault("MASTER_PORT", "29511")
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    return rank, world_size, local_rank


class ERA5Dataset(Dataset):
    """x_t and the next n_steps 6-hourly states; h5 handles are opened lazily in each worker."""

    def __init__(self, data_dir, years, stats_dir, n_steps=1):
        self.files = [os.path.join(data_dir, f"{y}.h5") for y in years]
        self.n_steps = n_steps
        self.n_per_year = []
        for path in self.files:
            with h5py.File(path, "r") as f:
                self.n_per_year.append(f["fields"].shape[0] - n_steps)
        self.offsets = np.cumsum([0] + self.n_per_year)
        self.mean = np.load(os.path.join(stats_dir, "global_means.npy")).astype(np.float32)  # (1, C, 1, 1)
        self.std = np.load(os.path.join(stats_dir, "global_stds.npy")).astype(np.float32)
        self._handles = {}

    def __len__(self):
        return int(self.offsets[-1])

    def _fields(self, i):
        if i not in self._handles:
            self._handles[i] = h5py.File(self.files[i], "r")["fields"]
        return self._handles[i]

    def __getitem__(self, idx):
        yi = int(np.searchsorted(self.offsets, idx, side="right") - 1)
        t = int(idx - self.offsets[yi])
        f = self._fields(yi)
        x = (f[t, :, :720] - self.mean[0]) / self.std[0]
        y = (f[t + 1:t + 1 + self.n_steps, :, :720] - self.mean) / self.std
        if self.n_steps == 1:
            y = y[0]
        return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.float32))


class AFNO2D(nn.Module):
    def __init__(self, dim, num_blocks=8, sparsity=0.01):
        super().__init__()
        self.nb, self.bs = num_blocks, dim // num_blocks
        self.sparsity = sparsity
        s = 0.02
        self.w1 = nn.Parameter(s * torch.randn(2, self.nb, self.bs, self.bs))
        self.b1 = nn.Parameter(s * torch.randn(2, self.nb, self.bs))
        self.w2 = nn.Parameter(s * torch.randn(2, self.nb, self.bs, self.bs))
        self.b2 = nn.Parameter(s * torch.randn(2, self.nb, self.bs))

    def forward(self, x):
        bias, dtype = x, x.dtype
        x = x.float()
        B, H, W, C = x.shape
        x = torch.fft.rfft2(x, dim=(1, 2), norm="ortho").reshape(B, H, W // 2 + 1, self.nb, self.bs)
        mm = lambda a, w: torch.einsum("...bi,bio->...bo", a, w)
        r1 = F.relu(mm(x.real, self.w1[0]) - mm(x.imag, self.w1[1]) + self.b1[0])
        i1 = F.relu(mm(x.imag, self.w1[0]) + mm(x.real, self.w1[1]) + self.b1[1])
        r2 = mm(r1, self.w2[0]) - mm(i1, self.w2[1]) + self.b2[0]
        i2 = mm(i1, self.w2[0]) + mm(r1, self.w2[1]) + self.b2[1]
        x = F.softshrink(torch.stack([r2, i2], dim=-1), lambd=self.sparsity)
        x = torch.view_as_complex(x).reshape(B, H, W // 2 + 1, C)
        x = torch.fft.irfft2(x, s=(H, W), dim=(1, 2), norm="ortho")
        return x.to(dtype) + bias


class Block(nn.Module):
    def __init__(self, dim, mlp_ratio=4.0):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.filter = AFNO2D(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x):
        residual = x
        x = self.filter(self.norm1(x)) + residual
        return x + self.mlp(self.norm2(x))


class AFNONet(nn.Module):
    def __init__(self, img=(720, 1440), patch=8, in_ch=20, out_ch=20, dim=768, depth=12):
        super().__init__()
        self.h, self.w, self.p, self.out_ch = img[0] // patch, img[1] // patch, patch, out_ch
        self.embed = nn.Conv2d(in_ch, dim, kernel_size=patch, stride=patch)
        self.pos = nn.Parameter(torch.zeros(1, self.h, self.w, dim))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, out_ch * patch * patch, bias=False)

    def forward(self, x):
        B = x.shape[0]
        x = self.embed(x).permute(0, 2, 3, 1) + self.pos
        for blk in self.blocks:
            x = blk(x)
        x = self.head(x).reshape(B, self.h, self.w, self.p, self.p, self.out_ch)
        x = x.permute(0, 5, 1, 3, 2, 4).reshape(B, self.out_ch, self.h * self.p, self.w * self.p)
        return x


def lat_weights(n_lat, device):
    lat = torch.linspace(90, -90, 721, device=device)[:n_lat]
    w = torch.cos(torch.deg2rad(lat))
    return (w / w.mean()).view(1, 1, -1, 1)


@torch.no_grad()
def validate(net, loader, std, weights, steps, device):
    """Sums of latitude-weighted squared errors (physical units) along a rollout."""
    net.eval()
    chans = [Z500, T2M]
    scale = std.view(-1)[chans].view(1, 2, 1, 1)
    sq = torch.zeros(steps, 2, device=device)
    count = torch.zeros(1, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        state = x
        for k in range(steps):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                state = net(state).float()
            err = (state[:, chans] - y[:, k, chans]) * scale
            sq[k] += (weights * err ** 2).mean(dim=(2, 3)).sum(dim=0)
        count += x.shape[0]
    return sq, count


def main():
    args = get_args()
    rank, world_size, local_rank = setup_distributed()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)
    torch.backends.cuda.matmul.allow_tf32 = True

    assert args.global_batch % world_size == 0
    local_batch = args.global_batch // world_size
    train_ds = ERA5Dataset(args.data_dir, year_range(args.train_years), args.stats_dir)
    val_ds = ERA5Dataset(args.data_dir, year_range(args.valid_years), args.stats_dir, n_steps=args.val_steps)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=1234, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=local_batch, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_idx = np.linspace(0, len(val_ds) - 1, args.val_samples).astype(int)
    val_loader = DataLoader(Subset(val_ds, val_idx[rank::world_size].tolist()), batch_size=1, num_workers=2)

    net = AFNONet(patch=args.patch, dim=args.embed_dim, depth=args.depth).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    weights = lat_weights(720, device)
    std = torch.from_numpy(train_ds.std).to(device)

    os.makedirs(args.exp_dir, exist_ok=True)
    ckpt_path = os.path.join(args.exp_dir, "ckpt.tar")
    start_epoch, step = 0, 0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, step = ckpt["epoch"] + 1, ckpt["step"]
        if rank == 0:
            print(f"resuming at epoch {start_epoch} (step {step})", flush=True)

    # Slurm sends SIGUSR1 (--signal=USR1@300) before the time limit; the ranks agree on
    # stopping through an all_reduce so that they all leave the loop at the same step.
    preempt = {"flag": False}

    def on_sigusr1(signum, frame):
        preempt["flag"] = True

    signal.signal(signal.SIGUSR1, on_sigusr1)

    def save(epoch):
        if rank == 0:
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "step": step,
                        "args": vars(args)}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    stop = False
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x)
            loss = (weights * (pred.float() - y) ** 2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % 100 == 0:
                flag = torch.tensor([float(preempt["flag"])], device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                stop = flag.item() > 0
                if stop:
                    break
                loss_avg = loss.detach().clone()
                dist.all_reduce(loss_avg)
                if rank == 0:
                    print(f"ep {epoch} it {i}/{len(train_loader)} loss {loss_avg.item() / world_size:.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
        if stop:
            # the epoch is not complete; restart it from the beginning after requeue
            save(epoch - 1)
            break

        sq, count = validate(net, val_loader, std, weights, args.val_steps, device)
        dist.all_reduce(sq)
        dist.all_reduce(count)
        rmse = torch.sqrt(sq / count)
        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s | "
                  f"z500 RMSE@{6 * args.val_steps}h {rmse[-1, 0].item():.1f} m2/s2 | "
                  f"t2m RMSE@{6 * args.val_steps}h {rmse[-1, 1].item():.2f} K", flush=True)
        save(epoch)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
