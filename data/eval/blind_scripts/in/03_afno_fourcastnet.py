# FourCastNet-style AFNO training on 0.25 deg ERA5 (20 channels, 720x1440 crop).
# Data layout follows the original release: one HDF5 per year with a "fields" dataset (T, C, 721, 1440).
#
#   torchrun --nproc_per_node=8 03_afno_fourcastnet.py --exp afno_bs64
import argparse
import glob
import json
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.fft
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

CHANNELS = ["u10", "v10", "t2m", "sp", "msl", "t850", "u1000", "v1000", "z1000", "u850",
            "v850", "z850", "u500", "v500", "z500", "t500", "z50", "r500", "r850", "tcwv"]


class H5Years(Dataset):
    def __init__(self, files, mean, std, dt=1):
        self.files = sorted(files)
        self.dt = dt
        self.mean, self.std = mean, std
        self.n_per_year = []
        for f in self.files:
            with h5py.File(f, "r") as h:
                self.n_per_year.append(h["fields"].shape[0] - dt)
        self.offsets = np.cumsum([0] + self.n_per_year)
        self.handles = {}

    def __len__(self):
        return int(self.offsets[-1])

    def _h(self, i):
        if i not in self.handles:
            self.handles[i] = h5py.File(self.files[i], "r")["fields"]
        return self.handles[i]

    def __getitem__(self, idx):
        y = int(np.searchsorted(self.offsets, idx, side="right") - 1)
        t = idx - self.offsets[y]
        f = self._h(y)
        x = (f[t, :, :720] - self.mean) / self.std
        tgt = (f[t + self.dt, :, :720] - self.mean) / self.std
        return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(tgt.astype(np.float32))


class AFNO2D(nn.Module):
    def __init__(self, dim, num_blocks=8, sparsity=0.01, keep_modes=1.0):
        super().__init__()
        self.nb, self.bs = num_blocks, dim // num_blocks
        self.sparsity, self.keep_modes = sparsity, keep_modes
        s = 0.02
        self.w1 = nn.Parameter(s * torch.randn(2, num_blocks, self.bs, self.bs))
        self.b1 = nn.Parameter(s * torch.randn(2, num_blocks, self.bs))
        self.w2 = nn.Parameter(s * torch.randn(2, num_blocks, self.bs, self.bs))
        self.b2 = nn.Parameter(s * torch.randn(2, num_blocks, self.bs))

    def forward(self, x):
        bias = x
        dtype = x.dtype
        x = x.float()
        B, H, W, C = x.shape
        x = torch.fft.rfft2(x, dim=(1, 2), norm="ortho").reshape(B, H, W // 2 + 1, self.nb, self.bs)
        r1 = F.relu(torch.einsum("...bi,bio->...bo", x.real, self.w1[0])
                    - torch.einsum("...bi,bio->...bo", x.imag, self.w1[1]) + self.b1[0])
        i1 = F.relu(torch.einsum("...bi,bio->...bo", x.imag, self.w1[0])
                    + torch.einsum("...bi,bio->...bo", x.real, self.w1[1]) + self.b1[1])
        r2 = (torch.einsum("...bi,bio->...bo", r1, self.w2[0])
              - torch.einsum("...bi,bio->...bo", i1, self.w2[1]) + self.b2[0])
        i2 = (torch.einsum("...bi,bio->...bo", i1, self.w2[0])
              + torch.einsum("...bi,bio->...bo", r1, self.w2[1]) + self.b2[1])
        x = F.softshrink(torch.stack([r2, i2], dim=-1), lambd=self.sparsity)
        x = torch.view_as_complex(x.contiguous()).reshape(B, H, W // 2 + 1, C)
        x = torch.fft.irfft2(x, s=(H, W), dim=(1, 2), norm="ortho")
        return x.type(dtype) + bias


class AFNOBlock(nn.Module):
    def __init__(self, dim, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.filter = AFNO2D(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(),
                                 nn.Linear(int(dim * mlp_ratio), dim))

    def forward(self, x):
        x = x + self.filter(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class AFNONet(nn.Module):
    def __init__(self, in_ch=20, out_ch=20, img=(720, 1440), patch=8, dim=768, depth=12):
        super().__init__()
        self.p = patch
        self.h, self.w = img[0] // patch, img[1] // patch
        self.patch_embed = nn.Conv2d(in_ch, dim, patch, patch)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.h, self.w, dim))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        self.blocks = nn.ModuleList([AFNOBlock(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, out_ch * patch * patch, bias=False)
        self.out_ch = out_ch

    def forward(self, x):
        B = x.shape[0]
        x = self.patch_embed(x).permute(0, 2, 3, 1) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        x = self.head(x).view(B, self.h, self.w, self.p, self.p, self.out_ch)
        return x.permute(0, 5, 1, 3, 2, 4).reshape(B, self.out_ch, self.h * self.p, self.w * self.p)


def weighted_rmse_channels(pred, target, lat_w):
    return torch.sqrt(((pred - target) ** 2 * lat_w).mean(dim=(-1, -2)))


@torch.no_grad()
def validate(model, loader, lat_w, std, device):
    model.eval()
    total, n = torch.zeros(len(CHANNELS), device=device), 0
    loss_sum = 0.0
    for inp, tar in loader:
        inp, tar = inp.to(device), tar.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            gen = model(inp)
        gen = gen.float()
        loss_sum += F.mse_loss(gen, tar).item() * inp.shape[0]
        total += weighted_rmse_channels(gen * std, tar * std, lat_w).sum(0)
        n += inp.shape[0]
    model.train()
    return loss_sum / n, (total / n).cpu()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--exp", required=True)
    parser.add_argument("--root", default="/pscratch/era5_0.25")
    parser.add_argument("--run-dir", default="/pscratch/fcn_runs")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--epochs", type=int, default=80)
    parser.add_argument("--num-workers", type=int, default=8)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", local_rank)
    run_dir = os.path.join(args.run_dir, args.exp)

    mean = np.load(os.path.join(args.root, "stats/global_means.npy"))[0, :len(CHANNELS)]
    std = np.load(os.path.join(args.root, "stats/global_stds.npy"))[0, :len(CHANNELS)]
    train_files = [f for f in glob.glob(f"{args.root}/train/*.h5") if int(os.path.basename(f)[:4]) <= 2015]
    val_files = glob.glob(f"{args.root}/test/2016.h5") + glob.glob(f"{args.root}/test/2017.h5")
    train_set = H5Years(train_files, mean, std)
    val_set = H5Years(val_files, mean, std)

    local_bs = args.global_batch // world
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=local_bs, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=local_bs, sampler=val_sampler,
                            num_workers=args.num_workers, pin_memory=True)

    model = AFNONet(in_ch=len(CHANNELS), out_ch=len(CHANNELS)).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    lat = np.linspace(90, -90, 721)[:720]
    lat_w = torch.tensor(np.cos(np.deg2rad(lat)), dtype=torch.float32, device=device)
    lat_w = (lat_w / lat_w.mean()).view(1, 1, -1, 1)
    std_t = torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1)

    writer = None
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(run_dir, "tb"))
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    best_val = float("inf")
    gstep = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        tic = time.time()
        for inp, tar in train_loader:
            inp = inp.to(device, non_blocking=True)
            tar = tar.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                gen = model(inp)
            loss = F.mse_loss(gen.float(), tar)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            gstep += 1
            if writer is not None and gstep % 20 == 0:
                writer.add_scalar("train/loss", loss.item(), gstep)
        scheduler.step()

        val_loss, val_rmse = validate(model, val_loader, lat_w, std_t, device)
        if rank == 0:
            writer.add_scalar("val/loss", val_loss, epoch)
            for name, r in zip(CHANNELS, val_rmse.tolist()):
                writer.add_scalar(f"val_rmse/{name}", r, epoch)
            print(f"epoch {epoch} took {time.time() - tic:.0f}s val_loss {val_loss:.5f} "
                  f"z500 {val_rmse[CHANNELS.index('z500')]:.2f} t850 {val_rmse[CHANNELS.index('t850')]:.3f}",
                  flush=True)
            state = {"model_state": model.module.state_dict(),
                     "optimizer_state_dict": optimizer.state_dict(),
                     "scheduler_state_dict": scheduler.state_dict(), "epoch": epoch}
            torch.save(state, os.path.join(run_dir, "ckpt.tar"))
            if val_loss <= best_val:
                best_val = val_loss
                torch.save(state, os.path.join(run_dir, "best_ckpt.tar"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
