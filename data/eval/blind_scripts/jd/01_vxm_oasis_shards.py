#!/usr/bin/env python
"""
Unsupervised VoxelMorph (atlas -> subject) on preprocessed OASIS volumes.

Each .npz holds `vol` (160x192x224, float32, [0,1]) and `seg` (int16, 35 labels).
Volumes are small enough to keep in RAM, so every rank loads only the
subjects it trains on.

    torchrun --nproc_per_node=4 01_vxm_oasis_shards.py \
        --data /data/oasis/npz --atlas /data/oasis/atlas.npz --out runs/vxm_oasis
"""
import argparse
import glob
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--atlas", required=True)
    p.add_argument("--out", default="runs/vxm_oasis")
    p.add_argument("--epochs", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lambda-grad", type=float, default=1.0)
    p.add_argument("--int-steps", type=int, default=7)
    p.add_argument("--n-val", type=int, default=20)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--save-every", type=int, default=10)
    return p.parse_args()


# ----------------------------------------------------------------------------- model
class ConvBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv = nn.Conv3d(cin, cout, 3, stride, 1)
        self.act = nn.LeakyReLU(0.2)

    def forward(self, x):
        return self.act(self.conv(x))


class Unet3D(nn.Module):
    def __init__(self, cin=2, enc_nf=(16, 32, 32, 32), dec_nf=(32, 32, 32, 32, 16, 16)):
        super().__init__()
        self.down = nn.ModuleList()
        prev = cin
        for nf in enc_nf:
            self.down.append(ConvBlock(prev, nf, stride=2))
            prev = nf
        skip_ch = [cin] + list(enc_nf[:-1])
        self.up = nn.ModuleList()
        for i, nf in enumerate(dec_nf[: len(enc_nf)]):
            self.up.append(ConvBlock(prev + skip_ch[-(i + 1)], nf))
            prev = nf
        self.extra = nn.ModuleList()
        for nf in dec_nf[len(enc_nf):]:
            self.extra.append(ConvBlock(prev, nf))
            prev = nf
        self.out_ch = prev
        self.upsample = nn.Upsample(scale_factor=2, mode="nearest")

    def forward(self, x):
        skips = [x]
        for layer in self.down:
            x = layer(x)
            skips.append(x)
        skips.pop()
        for layer in self.up:
            x = self.upsample(x)
            x = layer(torch.cat([x, skips.pop()], dim=1))
        for layer in self.extra:
            x = layer(x)
        return x


class SpatialTransformer(nn.Module):
    def __init__(self, size, mode="bilinear"):
        super().__init__()
        self.mode = mode
        grids = torch.meshgrid([torch.arange(0, s) for s in size], indexing="ij")
        self.register_buffer("grid", torch.stack(grids).unsqueeze(0).float(), persistent=False)

    def forward(self, src, flow, mode=None):
        locs = self.grid + flow
        shape = flow.shape[2:]
        for i in range(len(shape)):
            locs[:, i] = 2 * (locs[:, i] / (shape[i] - 1) - 0.5)
        locs = locs.permute(0, 2, 3, 4, 1)[..., [2, 1, 0]]
        return F.grid_sample(src, locs, align_corners=True, mode=mode or self.mode)


class VecInt(nn.Module):
    def __init__(self, size, nsteps):
        super().__init__()
        self.nsteps = nsteps
        self.scale = 1.0 / (2 ** nsteps)
        self.transformer = SpatialTransformer(size)

    def forward(self, vec):
        vec = vec * self.scale
        for _ in range(self.nsteps):
            vec = vec + self.transformer(vec, vec)
        return vec


class VxmDense(nn.Module):
    def __init__(self, inshape, int_steps=7):
        super().__init__()
        self.unet = Unet3D(2)
        self.flow = nn.Conv3d(self.unet.out_ch, 3, 3, padding=1)
        nn.init.normal_(self.flow.weight, 0.0, 1e-5)
        nn.init.zeros_(self.flow.bias)
        self.integrate = VecInt(inshape, int_steps) if int_steps > 0 else None
        self.transformer = SpatialTransformer(inshape)

    def forward(self, moving, fixed):
        flow = self.flow(self.unet(torch.cat([moving, fixed], dim=1)))
        if self.integrate is not None:
            flow = self.integrate(flow)
        return self.transformer(moving, flow), flow


# ----------------------------------------------------------------------------- losses
def ncc_loss(y_true, y_pred, win=9):
    filt = torch.ones(1, 1, win, win, win, device=y_true.device)
    pad = win // 2
    n = float(win ** 3)
    sums = [F.conv3d(t, filt, padding=pad) for t in (y_true, y_pred, y_true * y_true,
                                                       y_pred * y_pred, y_true * y_pred)]
    i_sum, j_sum, i2_sum, j2_sum, ij_sum = sums
    u_i, u_j = i_sum / n, j_sum / n
    cross = ij_sum - u_j * i_sum - u_i * j_sum + u_i * u_j * n
    i_var = i2_sum - 2 * u_i * i_sum + u_i * u_i * n
    j_var = j2_sum - 2 * u_j * j_sum + u_j * u_j * n
    return -torch.mean(cross * cross / (i_var * j_var + 1e-5))


def grad_loss(flow):
    dz = flow[:, :, 1:] - flow[:, :, :-1]
    dy = flow[:, :, :, 1:] - flow[:, :, :, :-1]
    dx = flow[:, :, :, :, 1:] - flow[:, :, :, :, :-1]
    return (dz.pow(2).mean() + dy.pow(2).mean() + dx.pow(2).mean()) / 3.0


def dice(seg_a, seg_b, labels):
    out = []
    for lab in labels:
        a, b = seg_a == lab, seg_b == lab
        out.append(2.0 * (a & b).sum().float() / (a.sum() + b.sum()).clamp(min=1).float())
    return torch.stack(out).mean()


# ----------------------------------------------------------------------------- data
class AtlasToSubject(Dataset):
    def __init__(self, files, atlas_vol, with_seg=False):
        self.atlas = torch.from_numpy(atlas_vol)[None]
        self.with_seg = with_seg
        self.items = []
        for f in files:
            d = np.load(f)
            self.items.append((d["vol"].astype(np.float32), d["seg"].astype(np.int64) if with_seg else None))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        vol, seg = self.items[i]
        fixed = torch.from_numpy(vol)[None]
        if self.with_seg:
            return self.atlas, fixed, torch.from_numpy(seg)[None]
        return self.atlas, fixed


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    atlas = np.load(args.atlas)
    atlas_vol = atlas["vol"].astype(np.float32)
    atlas_seg = torch.from_numpy(atlas["seg"].astype(np.int64))[None, None].to(device)
    labels = [int(l) for l in np.unique(atlas["seg"]) if l != 0]
    inshape = atlas_vol.shape

    files = sorted(glob.glob(os.path.join(args.data, "*.npz")))
    val_files, train_files = files[: args.n_val], files[args.n_val:]
    train_ds = AtlasToSubject(train_files[rank::world_size], atlas_vol)
    val_ds = AtlasToSubject(val_files[rank::world_size], atlas_vol, with_seg=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.workers, pin_memory=True, persistent_workers=True)
    if rank == 0:
        print(f"{len(files)} subjects, {len(train_files)} train / {len(val_files)} val, "
              f"{len(train_ds)} on rank 0", flush=True)

    model = VxmDense(inshape, args.int_steps).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    writer = SummaryWriter(args.out) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        run_loss = torch.zeros(2, device=device)
        for moving, fixed in train_loader:
            moving = moving.to(device, non_blocking=True)
            fixed = fixed.to(device, non_blocking=True)
            warped, flow = model(moving, fixed)
            sim = ncc_loss(fixed, warped)
            reg = grad_loss(flow)
            loss = sim + args.lambda_grad * reg
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run_loss += torch.stack([loss.detach(), torch.ones((), device=device)])
            step += 1
            if rank == 0 and step % 50 == 0:
                writer.add_scalar("train/ncc", sim.item(), step)
                writer.add_scalar("train/grad", reg.item(), step)

        dist.all_reduce(run_loss)
        mean_loss = (run_loss[0] / run_loss[1]).item()

        # validation: each rank warps the atlas segmentation to its own val subjects
        net = model.module
        net.eval()
        dsum = torch.zeros(2, device=device)
        with torch.no_grad():
            for i in range(len(val_ds)):
                moving, fixed, seg = (t[None].to(device) for t in val_ds[i])
                _, flow = net(moving, fixed)
                warped_seg = net.transformer(atlas_seg.float(), flow, mode="nearest").long()
                dsum[0] += dice(warped_seg, seg, labels)
                dsum[1] += 1
        dist.all_reduce(dsum)
        val_dice = (dsum[0] / dsum[1]).item()

        if rank == 0:
            writer.add_scalar("train/loss_epoch", mean_loss, epoch)
            writer.add_scalar("val/dice", val_dice, epoch)
            print(f"epoch {epoch:03d} loss {mean_loss:.4f} val dice {val_dice:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if (epoch + 1) % args.save_every == 0 or epoch == args.epochs - 1:
                torch.save({"epoch": epoch, "model": net.state_dict(), "optimizer": opt.state_dict()},
                           os.path.join(args.out, f"vxm_{epoch + 1:04d}.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
