"""
3D U-Net for brain tumour segmentation (BraTS 2021, 4 MRI modalities -> WT/TC/ET).

Launch (as in our lab README):
    python -m torch.distributed.launch --nproc_per_node=4 --master_port=29511 \
        03_brats_unet3d.py --data_dir /datasets/BraTS2021 --epochs 300

Environment: torch 2.1, CUDA 12.1, nibabel 5.
"""
import argparse
import glob
import json
import os
import time

import nibabel as nib
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

MODALITIES = ["flair", "t1", "t1ce", "t2"]


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_dir", default="/datasets/BraTS2021")
    parser.add_argument("--split_file", default="splits/fold0.json")
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--batch_size", type=int, default=2, help="per GPU")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--roi", type=int, nargs=3, default=[128, 128, 128])
    parser.add_argument("--val_every", type=int, default=10)
    parser.add_argument("--out_dir", default="runs/brats_unet3d")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def load_case(case_dir):
    name = os.path.basename(case_dir)
    imgs = [nib.load(os.path.join(case_dir, f"{name}_{m}.nii.gz")).get_fdata(dtype=np.float32)
            for m in MODALITIES]
    img = np.stack(imgs, 0)
    seg = nib.load(os.path.join(case_dir, f"{name}_seg.nii.gz")).get_fdata().astype(np.uint8)
    # per-channel z-score on brain voxels
    for c in range(img.shape[0]):
        brain = img[c][img[c] > 0]
        if brain.size:
            img[c] = np.where(img[c] > 0, (img[c] - brain.mean()) / (brain.std() + 1e-8), 0)
    # convert labels {0,1,2,4} to 3 overlapping regions: WT, TC, ET
    wt = (seg > 0)
    tc = (seg == 1) | (seg == 4)
    et = (seg == 4)
    lab = np.stack([wt, tc, et], 0).astype(np.float32)
    return img, lab


class BraTSDataset(Dataset):
    def __init__(self, case_dirs, roi, train=True):
        self.case_dirs = case_dirs
        self.roi = roi
        self.train = train

    def __len__(self):
        return len(self.case_dirs)

    def _crop(self, img, lab):
        _, d, h, w = img.shape
        rd, rh, rw = self.roi
        fg = np.argwhere(lab[0] > 0)
        if self.train and len(fg) and np.random.rand() < 0.67:
            cz, cy, cx = fg[np.random.randint(len(fg))]
        else:
            cz, cy, cx = np.random.randint(d), np.random.randint(h), np.random.randint(w)
        z0 = int(np.clip(cz - rd // 2, 0, d - rd))
        y0 = int(np.clip(cy - rh // 2, 0, h - rh))
        x0 = int(np.clip(cx - rw // 2, 0, w - rw))
        return img[:, z0:z0 + rd, y0:y0 + rh, x0:x0 + rw], lab[:, z0:z0 + rd, y0:y0 + rh, x0:x0 + rw]

    def __getitem__(self, i):
        img, lab = load_case(self.case_dirs[i])
        if self.train:
            img, lab = self._crop(img, lab)
            for ax in (1, 2, 3):
                if np.random.rand() < 0.5:
                    img, lab = np.flip(img, ax), np.flip(lab, ax)
        return torch.from_numpy(img.copy()), torch.from_numpy(lab.copy())


def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv3d(cin, cout, 3, padding=1, bias=False), nn.InstanceNorm3d(cout, affine=True), nn.LeakyReLU(0.01, True),
        nn.Conv3d(cout, cout, 3, padding=1, bias=False), nn.InstanceNorm3d(cout, affine=True), nn.LeakyReLU(0.01, True),
    )


class UNet3D(nn.Module):
    def __init__(self, in_ch=4, out_ch=3, base=32):
        super().__init__()
        ch = [base, base * 2, base * 4, base * 8, base * 10]
        self.enc = nn.ModuleList([conv_block(in_ch, ch[0])] + [conv_block(ch[i], ch[i + 1]) for i in range(4)])
        self.up = nn.ModuleList([nn.ConvTranspose3d(ch[i + 1], ch[i], 2, stride=2) for i in reversed(range(4))])
        self.dec = nn.ModuleList([conv_block(ch[i] * 2, ch[i]) for i in reversed(range(4))])
        self.head = nn.Conv3d(ch[0], out_ch, 1)

    def forward(self, x):
        skips = []
        for i, blk in enumerate(self.enc):
            x = blk(x if i == 0 else F.max_pool3d(x, 2))
            skips.append(x)
        x = skips.pop()
        for up, dec in zip(self.up, self.dec):
            x = dec(torch.cat([up(x), skips.pop()], 1))
        return self.head(x)


def dice_loss(logits, target, eps=1e-5):
    p = torch.sigmoid(logits)
    dims = (0, 2, 3, 4)
    inter = (p * target).sum(dims)
    return 1 - ((2 * inter + eps) / (p.sum(dims) + target.sum(dims) + eps)).mean()


@torch.no_grad()
def sliding_window(model, img, roi, overlap=0.5):
    _, _, D, H, W = img.shape
    out = torch.zeros((1, 3, D, H, W), device=img.device)
    cnt = torch.zeros((1, 1, D, H, W), device=img.device)
    steps = [max(1, int(r * (1 - overlap))) for r in roi]
    for z in list(range(0, max(D - roi[0], 0) + 1, steps[0])):
        for y in list(range(0, max(H - roi[1], 0) + 1, steps[1])):
            for x in list(range(0, max(W - roi[2], 0) + 1, steps[2])):
                patch = img[:, :, z:z + roi[0], y:y + roi[1], x:x + roi[2]]
                out[:, :, z:z + roi[0], y:y + roi[1], x:x + roi[2]] += torch.sigmoid(model(patch))
                cnt[:, :, z:z + roi[0], y:y + roi[1], x:x + roi[2]] += 1
    return out / cnt.clamp(min=1)


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{args.local_rank}")

    with open(args.split_file) as f:
        split = json.load(f)
    train_cases = [os.path.join(args.data_dir, c) for c in split["train"]]
    val_cases = [os.path.join(args.data_dir, c) for c in split["val"]]

    train_ds = BraTSDataset(train_cases, args.roi, train=True)
    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True)
    # validation: every rank takes every world-th case, dice sums are reduced afterwards
    val_ds = BraTSDataset(val_cases[rank::world], args.roi, train=False)
    val_loader = DataLoader(val_ds, batch_size=1, num_workers=4)

    model = UNet3D().to(device)
    model = DistributedDataParallel(model, device_ids=[args.local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        t0 = time.time()
        loss_sum = torch.zeros(1, device=device)
        for img, lab in loader:
            img, lab = img.to(device, non_blocking=True), lab.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(img)
            loss = dice_loss(logits.float(), lab) + F.binary_cross_entropy_with_logits(logits.float(), lab)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            loss_sum += loss.detach()
        scheduler.step()
        dist.all_reduce(loss_sum)
        if rank == 0:
            print(f"epoch {epoch} loss {loss_sum.item() / (world * len(loader)):.4f} time {time.time() - t0:.0f}s")

        if (epoch + 1) % args.val_every == 0:
            model.eval()
            dice_sum = torch.zeros(3, device=device)
            n = torch.zeros(1, device=device)
            for img, lab in val_loader:
                img, lab = img.to(device), lab.to(device)
                with torch.autocast("cuda", dtype=torch.float16):
                    prob = sliding_window(model.module, img, args.roi)
                pred = (prob > 0.5).float()
                inter = (pred * lab).sum((0, 2, 3, 4))
                dice_sum += 2 * inter / (pred.sum((0, 2, 3, 4)) + lab.sum((0, 2, 3, 4)) + 1e-5)
                n += 1
            dist.all_reduce(dice_sum)
            dist.all_reduce(n)
            dice = (dice_sum / n).tolist()
            if rank == 0:
                mean_dice = sum(dice) / 3
                print(f"  val dice WT {dice[0]:.4f} TC {dice[1]:.4f} ET {dice[2]:.4f} mean {mean_dice:.4f}")
                if mean_dice > best:
                    best = mean_dice
                    torch.save({"epoch": epoch, "state_dict": model.module.state_dict(), "dice": dice},
                               os.path.join(args.out_dir, "best_model.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
