"""FourCastNet-style AFNO training on ERA5 (0.25 deg, 20 channels) with
autoregressive validation rollouts scored per lead time.

    srun --ntasks-per-node=1 torchrun --nnodes=$SLURM_NNODES --nproc_per_node=4 \
        --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 02_afno_era5.py --config cfg/afno_era5.yaml
"""
import argparse
import glob
import logging
import os

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("afno")


class ERA5Dataset(Dataset):
    """Samples are (x_t, [x_{t+1}, ..., x_{t+n_steps}]) from yearly h5 files."""

    def __init__(self, data_dir, years, channels, mean, std, n_steps=1, dt=1):
        self.files = [os.path.join(data_dir, f"{y}.h5") for y in years]
        self.channels = channels
        self.mean, self.std = mean, std
        self.n_steps, self.dt = n_steps, dt
        self.index = []
        for fi, path in enumerate(self.files):
            with h5py.File(path, "r") as f:
                n = f["fields"].shape[0]
            self.index += [(fi, t) for t in range(n - n_steps * dt)]
        self._handles = {}

    def __len__(self):
        return len(self.index)

    def _read(self, fi, t):
        if fi not in self._handles:
            self._handles[fi] = h5py.File(self.files[fi], "r")
        x = self._handles[fi]["fields"][t, self.channels, :720]
        return (x - self.mean) / self.std

    def __getitem__(self, i):
        fi, t = self.index[i]
        x0 = torch.from_numpy(self._read(fi, t).astype(np.float32))
        tgt = np.stack([self._read(fi, t + k * self.dt) for k in range(1, self.n_steps + 1)])
        return x0, torch.from_numpy(tgt.astype(np.float32))


class AFNOBlock(nn.Module):
    def __init__(self, dim, num_blocks=8, sparsity=0.01, mlp_ratio=4.0):
        super().__init__()
        self.num_blocks, self.bs = num_blocks, dim // num_blocks
        self.sparsity = sparsity
        s = 0.02
        self.w1 = nn.Parameter(s * torch.randn(2, num_blocks, self.bs, self.bs))
        self.b1 = nn.Parameter(s * torch.randn(2, num_blocks, self.bs))
        self.w2 = nn.Parameter(s * torch.randn(2, num_blocks, self.bs, self.bs))
        self.b2 = nn.Parameter(s * torch.randn(2, num_blocks, self.bs))
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def spectral_filter(self, x):
        B, H, W, C = x.shape
        xf = torch.fft.rfft2(x.float(), dim=(1, 2), norm="ortho")
        xf = xf.reshape(B, H, W // 2 + 1, self.num_blocks, self.bs)
        o1r = F.relu(torch.einsum("...bi,bio->...bo", xf.real, self.w1[0]) - torch.einsum("...bi,bio->...bo", xf.imag, self.w1[1]) + self.b1[0])
        o1i = F.relu(torch.einsum("...bi,bio->...bo", xf.imag, self.w1[0]) + torch.einsum("...bi,bio->...bo", xf.real, self.w1[1]) + self.b1[1])
        o2r = torch.einsum("...bi,bio->...bo", o1r, self.w2[0]) - torch.einsum("...bi,bio->...bo", o1i, self.w2[1]) + self.b2[0]
        o2i = torch.einsum("...bi,bio->...bo", o1i, self.w2[0]) + torch.einsum("...bi,bio->...bo", o1r, self.w2[1]) + self.b2[1]
        xf = torch.view_as_complex(F.softshrink(torch.stack([o2r, o2i], -1), lambd=self.sparsity).contiguous())
        xf = xf.reshape(B, H, W // 2 + 1, C)
        return torch.fft.irfft2(xf, s=(H, W), dim=(1, 2), norm="ortho").type_as(x)

    def forward(self, x):
        x = x + self.spectral_filter(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class AFNONet(nn.Module):
    def __init__(self, in_ch, out_ch, img_size=(720, 1440), patch=8, dim=768, depth=12):
        super().__init__()
        self.h, self.w = img_size[0] // patch, img_size[1] // patch
        self.patch, self.out_ch = patch, out_ch
        self.embed = nn.Conv2d(in_ch, dim, kernel_size=patch, stride=patch)
        self.pos = nn.Parameter(torch.zeros(1, self.h, self.w, dim))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.blocks = nn.ModuleList([AFNOBlock(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, out_ch * patch * patch, bias=False)

    def forward(self, x):
        x = self.embed(x).permute(0, 2, 3, 1) + self.pos
        for blk in self.blocks:
            x = blk(x)
        x = self.head(x)  # B, h, w, C*p*p
        B = x.shape[0]
        x = x.reshape(B, self.h, self.w, self.patch, self.patch, self.out_ch)
        return x.permute(0, 5, 1, 3, 2, 4).reshape(B, self.out_ch, self.h * self.patch, self.w * self.patch)


def lat_weights(n_lat, device):
    lat = torch.linspace(90, -90 + 180 / 721, n_lat, device=device)
    w = torch.cos(torch.deg2rad(lat))
    return (w / w.mean()).view(1, 1, -1, 1)


@torch.no_grad()
def validate(net, loader, n_lead, std, device):
    """Latitude-weighted RMSE per lead time and channel, in physical units."""
    net.eval()
    wlat = None
    sq_err = None
    count = 0
    for x0, tgt in loader:
        x0, tgt = x0.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
        if wlat is None:
            wlat = lat_weights(x0.shape[-2], device)
            sq_err = torch.zeros(n_lead, x0.shape[1], device=device)
        x = x0
        with torch.autocast("cuda", dtype=torch.bfloat16):
            for k in range(n_lead):
                x = net(x).float()
                sq_err[k] += (wlat * (x - tgt[:, k]) ** 2).mean(dim=(-2, -1)).sum(0)
        count += x0.shape[0]
    rmse = torch.sqrt(sq_err / count) * std.view(1, -1)
    return rmse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")

    chans = cfg["channels"]
    mean = np.load(cfg["global_means"])[0, chans]  # (C,1,1)
    std = np.load(cfg["global_stds"])[0, chans]
    std_t = torch.as_tensor(std.reshape(-1), device=device, dtype=torch.float32)

    train_ds = ERA5Dataset(cfg["data_dir"], cfg["train_years"], chans, mean, std)
    val_ds = ERA5Dataset(cfg["data_dir"], cfg["val_years"], chans, mean, std,
                         n_steps=cfg["val_lead_steps"], dt=1)
    # validation initial conditions every 12 h
    val_ds.index = val_ds.index[:: cfg.get("val_stride", 2)]

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"] // world, sampler=train_sampler,
                              num_workers=cfg["num_workers"], pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=val_sampler, num_workers=4, pin_memory=True)

    model = AFNONet(len(chans), len(chans), patch=cfg["patch"], dim=cfg["embed_dim"], depth=cfg["depth"]).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.05)
    total_steps = cfg["epochs"] * len(train_loader)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps)

    ckpt_dir = cfg["ckpt_dir"]
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    best = float("inf")
    z500 = chans.index(cfg["z500_channel"])  # position of z500 among the trained channels

    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(2, device=device)
        for it, (x0, tgt) in enumerate(train_loader):
            x0 = x0.to(device, non_blocking=True)
            y = tgt[:, 0].to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x0)
            loss = F.mse_loss(pred.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
            if it % 200 == 0:
                dist.all_reduce(running)
                log.info(f"epoch {epoch} it {it}/{len(train_loader)} loss {running[0] / running[1]:.4f} "
                         f"lr {sched.get_last_lr()[0]:.2e}")
                running.zero_()

        rmse = validate(model.module, val_loader, cfg["val_lead_steps"], std_t, device)
        if rank == 0:
            for k in range(0, cfg["val_lead_steps"], 4):
                log.info(f"epoch {epoch} lead {6 * (k + 1):3d}h  z500 RMSE {rmse[k, z500]:.1f}  "
                         f"mean RMSE {rmse[k].mean():.3f}")
            score = rmse[-1, z500].item()
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                     "sched": sched.state_dict(), "epoch": epoch, "rmse": rmse.cpu()}
            torch.save(state, os.path.join(ckpt_dir, "ckpt_last.tar"))
            if score < best:
                best = score
                torch.save(state, os.path.join(ckpt_dir, "ckpt_best.tar"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
