"""Train MiDaS v2 (ResNeXt-101 encoder) on our in-house RGB-D captures.

Relative inverse depth, scale-and-shift-invariant trimmed MAE + gradient matching.
Launch:
    torchrun --nnodes=1 --nproc_per_node=8 06_midas_relative_depth.py \
        --data_root /mnt/datasets/rgbd_captures --out runs/midas_inhouse
"""
import argparse
import glob
import os
import random
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.transforms import Compose

from midas.midas_net import MidasNet
from midas.transforms import NormalizeImage, PrepareForNet, Resize


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", required=True)
    p.add_argument("--out", default="runs/midas")
    p.add_argument("--init", default="weights/midas_v21-f6b98070.pt")
    p.add_argument("--val_fraction", type=float, default=0.05)
    p.add_argument("--size", type=int, default=384)
    p.add_argument("--batch_size", type=int, default=8, help="per GPU")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trim", type=float, default=0.2)
    return p.parse_args()


class RGBDFolder(Dataset):
    def __init__(self, samples, size, train):
        self.samples = samples
        self.train = train
        self.transform = Compose([
            Resize(size, size, resize_target=True, keep_aspect_ratio=True, ensure_multiple_of=32,
                   resize_method="lower_bound", image_interpolation_method=cv2.INTER_CUBIC),
            NormalizeImage(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
            PrepareForNet(),
        ])
        self.size = size

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        rgb_path, depth_path = self.samples[i]
        img = cv2.cvtColor(cv2.imread(rgb_path), cv2.COLOR_BGR2RGB).astype(np.float32) / 255.0
        depth = cv2.imread(depth_path, cv2.IMREAD_ANYDEPTH).astype(np.float32) / 1000.0
        mask = (depth > 0.1) & (depth < 80.0)
        disp = np.zeros_like(depth)
        disp[mask] = 1.0 / depth[mask]

        if self.train and random.random() < 0.5:
            img, disp, mask = img[:, ::-1], disp[:, ::-1], mask[:, ::-1]
        sample = self.transform({"image": np.ascontiguousarray(img), "disparity": np.ascontiguousarray(disp),
                                 "mask": np.ascontiguousarray(mask)})
        image, disp, mask = sample["image"], sample["disparity"], sample["mask"]

        # random square crop (train) / center crop (val)
        h, w = disp.shape
        if self.train:
            y0, x0 = random.randint(0, h - self.size), random.randint(0, w - self.size)
        else:
            y0, x0 = (h - self.size) // 2, (w - self.size) // 2
        ys, xs = slice(y0, y0 + self.size), slice(x0, x0 + self.size)
        return (torch.from_numpy(np.ascontiguousarray(image[:, ys, xs])),
                torch.from_numpy(np.ascontiguousarray(disp[ys, xs])),
                torch.from_numpy(np.ascontiguousarray(mask[ys, xs])).float())


def list_samples(root):
    samples = []
    for rgb in sorted(glob.glob(os.path.join(root, "*", "rgb", "*.jpg"))):
        depth = rgb.replace(os.sep + "rgb" + os.sep, os.sep + "depth" + os.sep).replace(".jpg", ".png")
        if os.path.exists(depth):
            samples.append((rgb, depth))
    return samples


def normalize_disp(d, mask):
    """median / mean-absolute-deviation normalisation used by MiDaS."""
    b = d.shape[0]
    d_flat, m_flat = d.view(b, -1), mask.view(b, -1) > 0
    out = torch.zeros_like(d)
    for i in range(b):
        v = d_flat[i][m_flat[i]]
        if v.numel() < 10:
            continue
        t = v.median()
        s = (v - t).abs().mean().clamp(min=1e-6)
        out[i] = (d[i] - t) / s
    return out


def trimmed_mae_loss(pred, target, mask, trim):
    p, t = normalize_disp(pred, mask), normalize_disp(target, mask)
    losses = []
    for i in range(pred.shape[0]):
        r = (p[i] - t[i]).abs()[mask[i] > 0]
        if r.numel() == 0:
            losses.append(pred[i].sum() * 0.0)
            continue
        r, _ = torch.sort(r)
        keep = max(1, int(r.numel() * (1.0 - trim)))
        losses.append(r[:keep].mean())
    return torch.stack(losses).mean(), p, t


def gradient_loss(p, t, mask, scales=4):
    loss = 0.0
    for k in range(scales):
        s = 2 ** k
        d, m = (p - t)[:, ::s, ::s], mask[:, ::s, ::s]
        gx = (d[:, :, 1:] - d[:, :, :-1]).abs() * m[:, :, 1:] * m[:, :, :-1]
        gy = (d[:, 1:] - d[:, :-1]).abs() * m[:, 1:] * m[:, :-1]
        loss = loss + (gx.sum() + gy.sum()) / m.sum().clamp(min=1)
    return loss


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(2, device=device, dtype=torch.float64)
    for image, disp, mask in loader:
        image, disp, mask = image.to(device), disp.to(device), mask.to(device)
        pred = model(image)
        p, t = normalize_disp(pred, mask), normalize_disp(disp, mask)
        err = ((p - t).abs() * mask).sum((1, 2)) / mask.sum((1, 2)).clamp(min=1)
        stats[0] += err.sum()
        stats[1] += image.shape[0]
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1].clamp(min=1)).item()


def main():
    args = get_args()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    device = torch.device(f"cuda:{local_rank}")

    # different augmentation streams per process
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    samples = list_samples(args.data_root)
    random.shuffle(samples)
    n_val = int(len(samples) * args.val_fraction)
    val_samples, train_samples = samples[:n_val], samples[n_val:]
    if rank == 0:
        print(f"{len(train_samples)} train / {len(val_samples)} val samples", flush=True)

    train_set = RGBDFolder(train_samples, args.size, train=True)
    val_set = RGBDFolder(val_samples, args.size, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world_size)),
                            batch_size=args.batch_size, num_workers=args.workers)

    # the encoder comes through torch.hub: let one process per node fill the hub cache first
    if local_rank != 0:
        dist.barrier()
    model = MidasNet(args.init, non_negative=True)
    if local_rank == 0:
        dist.barrier()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    # scratch.refinenet4 only gets one input, so its resConfUnit1 never receives a gradient
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    encoder = [p for n, p in model.module.named_parameters() if n.startswith("pretrained.")]
    decoder = [p for n, p in model.module.named_parameters() if not n.startswith("pretrained.")]
    optimizer = torch.optim.Adam([{"params": encoder, "lr": args.lr},
                                  {"params": decoder, "lr": args.lr * 10}], betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (image, disp, mask) in enumerate(train_loader):
            image = image.to(device, non_blocking=True)
            disp = disp.to(device, non_blocking=True)
            mask = mask.to(device, non_blocking=True)

            pred = model(image)
            l_ssi, p, t = trimmed_mae_loss(pred, disp, mask, args.trim)
            l_grad = gradient_loss(p, t, mask)
            loss = l_ssi + 0.5 * l_grad

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()

            if it % 50 == 0:
                logged = torch.stack([l_ssi.detach(), l_grad.detach()])
                dist.all_reduce(logged)
                logged /= world_size
                if rank == 0:
                    print(f"[{epoch}:{it}/{len(train_loader)}] ssi {logged[0]:.4f} grad {logged[1]:.4f} "
                          f"({time.time() - tic:.0f}s)", flush=True)

        val_err = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: val ssi-mae {val_err:.4f}", flush=True)
            ckpt = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if val_err < best:
                best = val_err
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
