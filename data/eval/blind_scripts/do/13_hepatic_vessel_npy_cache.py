"""Hepatic vessel + tumour segmentation (MSD Task08) from a resampled .npy cache.

Resampling the portal-venous CTs to 0.8 x 0.8 x 1.5 mm is slow, so every case
is resampled once with SimpleITK and stored as float16/uint8 .npy next to a
small json with the original geometry. Training then reads memory-mapped
arrays and samples patches.

    torchrun --standalone --nproc_per_node=4 13_hepatic_vessel_npy_cache.py
"""
import argparse
import glob
import json
import os

import numpy as np
import SimpleITK as sitk
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.networks.nets import UNet

TARGET_SPACING = (0.8, 0.8, 1.5)  # x, y, z (SimpleITK order)
PATCH = (64, 160, 160)  # z, y, x (numpy order)


def resample(img, spacing, is_label):
    in_size, in_spacing = img.GetSize(), img.GetSpacing()
    out_size = [int(round(sz * sp / t)) for sz, sp, t in zip(in_size, in_spacing, spacing)]
    f = sitk.ResampleImageFilter()
    f.SetOutputSpacing(spacing)
    f.SetSize(out_size)
    f.SetOutputDirection(img.GetDirection())
    f.SetOutputOrigin(img.GetOrigin())
    f.SetInterpolator(sitk.sitkNearestNeighbor if is_label else sitk.sitkBSpline)
    f.SetDefaultPixelValue(0 if is_label else -1024)
    return f.Execute(img)


def build_cache(cases, cache_dir):
    os.makedirs(cache_dir, exist_ok=True)
    for img_path, lab_path in cases:
        cid = os.path.basename(img_path).replace(".nii.gz", "")
        out_img = os.path.join(cache_dir, f"{cid}_img.npy")
        if os.path.exists(out_img):
            continue
        img = sitk.ReadImage(img_path)
        lab = sitk.ReadImage(lab_path)
        img_r = sitk.GetArrayFromImage(resample(img, TARGET_SPACING, False)).astype(np.float32)
        lab_r = sitk.GetArrayFromImage(resample(lab, TARGET_SPACING, True)).astype(np.uint8)
        img_r = np.clip(img_r, -100, 250)
        img_r = ((img_r - 90.0) / 60.0).astype(np.float16)
        np.save(os.path.join(cache_dir, f"{cid}_lab.npy"), lab_r)
        np.save(out_img, img_r)
        with open(os.path.join(cache_dir, f"{cid}.json"), "w") as f:
            json.dump({"spacing": img.GetSpacing(), "origin": img.GetOrigin(),
                       "direction": img.GetDirection(), "size": img.GetSize()}, f)


class NpyPatchDataset(Dataset):
    def __init__(self, cache_dir, case_ids, patch, fg_prob=0.5, samples_per_case=8):
        self.cache_dir, self.ids = cache_dir, list(case_ids)
        self.patch, self.fg_prob, self.spc = np.array(patch), fg_prob, samples_per_case

    def __len__(self):
        return len(self.ids) * self.spc

    def __getitem__(self, i):
        cid = self.ids[i // self.spc]
        img = np.load(os.path.join(self.cache_dir, f"{cid}_img.npy"), mmap_mode="r")
        lab = np.load(os.path.join(self.cache_dir, f"{cid}_lab.npy"), mmap_mode="r")
        shape = np.array(img.shape)
        if np.random.rand() < self.fg_prob:
            fg = np.argwhere(lab[::4, ::4, ::4] > 0) * 4
            centre = fg[np.random.randint(len(fg))] if len(fg) else shape // 2
        else:
            centre = np.array([np.random.randint(0, s) for s in shape])
        lo = np.clip(centre - self.patch // 2, 0, np.maximum(shape - self.patch, 0))
        sl = tuple(slice(a, a + p) for a, p in zip(lo, self.patch))
        x = np.zeros(self.patch, np.float32)
        y = np.zeros(self.patch, np.int64)
        xi, yi = np.asarray(img[sl], np.float32), np.asarray(lab[sl], np.int64)
        x[tuple(slice(0, s) for s in xi.shape)] = xi
        y[tuple(slice(0, s) for s in yi.shape)] = yi
        if np.random.rand() < 0.5:
            x, y = x[:, :, ::-1], y[:, :, ::-1]
        return torch.from_numpy(x.copy())[None], torch.from_numpy(y.copy())[None]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw", default="/data/msd/Task08_HepaticVessel")
    ap.add_argument("--cache", default="/data/msd/Task08_HepaticVessel/npy_0.8x0.8x1.5")
    ap.add_argument("--out", default="/data/experiments/hepatic_vessel/unet_npy")
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--n_val", type=int, default=40)
    ap.add_argument("--val_every", type=int, default=25)
    return ap.parse_args()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    imgs = sorted(glob.glob(os.path.join(args.raw, "imagesTr", "hepaticvessel_*.nii.gz")))
    cases = [(p, p.replace("imagesTr", "labelsTr")) for p in imgs]
    build_cache(cases, args.cache)

    ids = [os.path.basename(p).replace(".nii.gz", "") for p, _ in cases]
    val_ids, train_ids = ids[: args.n_val], ids[args.n_val:]

    train_ds = NpyPatchDataset(args.cache, train_ids, PATCH)
    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True,
                        worker_init_fn=lambda w: np.random.seed(torch.initial_seed() % 2 ** 32))

    net = UNet(spatial_dims=3, in_channels=1, out_channels=3, channels=(32, 64, 128, 256, 320),
               strides=((1, 2, 2), 2, 2, 2), num_res_units=2, norm="instance").to(device)
    model = DDP(net, device_ids=[local_rank])
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, lambda_dice=1.0, lambda_ce=1.0)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=args.epochs, eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optim.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optim)
            scaler.update()
            tot += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch + 1} loss {(tot[0] / tot[1]).item():.4f}", flush=True)

        if (epoch + 1) % args.val_every == 0:
            net.eval()
            inter = torch.zeros(2, device=device)
            denom = torch.zeros(2, device=device)
            with torch.no_grad():
                for cid in val_ids[rank::world]:
                    img = torch.from_numpy(np.load(os.path.join(args.cache, f"{cid}_img.npy")).astype(np.float32))
                    lab = torch.from_numpy(np.load(os.path.join(args.cache, f"{cid}_lab.npy")).astype(np.int64))
                    img, lab = img[None, None].to(device), lab.to(device)
                    with torch.autocast("cuda", dtype=torch.float16):
                        pred = sliding_window_inference(img, PATCH, 4, net, overlap=0.5).argmax(1)[0]
                    for k, c in enumerate((1, 2)):  # vessel, tumour
                        inter[k] += ((pred == c) & (lab == c)).sum()
                        denom[k] += (pred == c).sum() + (lab == c).sum()
            dist.all_reduce(inter)
            dist.all_reduce(denom)
            dice = (2 * inter / denom.clamp(min=1)).tolist()
            if rank == 0:
                print(f"  global dice vessel {dice[0]:.4f} tumour {dice[1]:.4f}", flush=True)
                torch.save({"epoch": epoch + 1, "model": net.state_dict(), "optim": optim.state_dict()},
                           os.path.join(args.out, "last.pt"))
                if sum(dice) / 2 > best:
                    best = sum(dice) / 2
                    torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
