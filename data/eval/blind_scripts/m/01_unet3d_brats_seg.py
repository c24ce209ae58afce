#!/usr/bin/env python
"""
3D U-Net for brain tumour segmentation (BraTS 2021, 4 MRI modalities -> TC / WT / ET).

Preprocessed cases are .npz files (see preprocess_brats.py) with
    image: (4, 240, 240, 155) float32, z-scored per modality inside the brain mask
    label: (3, 240, 240, 155) uint8, channels = tumour core, whole tumour, enhancing tumour

Multi-GPU version of train_unet3d.py, launch with torchrun.
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

from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss


def get_args():
    p = argparse.ArgumentParser(description="3D UNet on BraTS (DDP)")
    p.add_argument("--data_dir", default="/data/brats2021/npz")
    p.add_argument("--split_json", default="splits/fold0.json")
    p.add_argument("--out_dir", default="runs/unet3d_fold0")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch_size", type=int, default=2, help="per GPU")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--weight_decay", type=float, default=1e-5)
    p.add_argument("--roi", type=int, nargs=3, default=[128, 128, 128])
    p.add_argument("--base_ch", type=int, default=32)
    p.add_argument("--val_every", type=int, default=10)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


# ----------------------------------------------------------------------------- data
class BratsNpzDataset(Dataset):
    def __init__(self, files, roi=(128, 128, 128), train=True):
        self.files = files
        self.roi = roi
        self.train = train

    def __len__(self):
        return len(self.files)

    def _crop(self, img, lab):
        _, H, W, D = img.shape
        rh, rw, rd = self.roi
        if np.random.rand() < 0.66 and lab.any():
            # foreground-centred crop, like RandCropByPosNegLabeld(pos=2, neg=1)
            fg = np.argwhere(lab[1] > 0)
            c = fg[np.random.randint(len(fg))]
            h0 = int(np.clip(c[0] - rh // 2, 0, H - rh))
            w0 = int(np.clip(c[1] - rw // 2, 0, W - rw))
            d0 = int(np.clip(c[2] - rd // 2, 0, D - rd))
        else:
            h0 = np.random.randint(0, H - rh + 1)
            w0 = np.random.randint(0, W - rw + 1)
            d0 = np.random.randint(0, D - rd + 1)
        sl = (slice(None), slice(h0, h0 + rh), slice(w0, w0 + rw), slice(d0, d0 + rd))
        return img[sl], lab[sl]

    def __getitem__(self, idx):
        d = np.load(self.files[idx])
        img = d["image"].astype(np.float32)
        lab = d["label"].astype(np.float32)
        if self.train:
            img, lab = self._crop(img, lab)
            for ax in (1, 2, 3):
                if np.random.rand() < 0.5:
                    img = np.flip(img, ax)
                    lab = np.flip(lab, ax)
            img = img * np.random.uniform(0.9, 1.1) + np.random.uniform(-0.1, 0.1)
        return torch.from_numpy(np.ascontiguousarray(img)), torch.from_numpy(np.ascontiguousarray(lab))


def load_split(split_json, data_dir):
    with open(split_json) as f:
        split = json.load(f)
    tr = [os.path.join(data_dir, c + ".npz") for c in split["train"]]
    va = [os.path.join(data_dir, c + ".npz") for c in split["val"]]
    return tr, va


# ----------------------------------------------------------------------------- model
class ConvBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv3d(cin, cout, 3, padding=1, bias=False),
            nn.BatchNorm3d(cout),
            nn.LeakyReLU(0.01, inplace=True),
            nn.Conv3d(cout, cout, 3, padding=1, bias=False),
            nn.BatchNorm3d(cout),
            nn.LeakyReLU(0.01, inplace=True),
        )

    def forward(self, x):
        return self.net(x)


class UNet3D(nn.Module):
    def __init__(self, in_ch=4, out_ch=3, base=32):
        super().__init__()
        chs = [base, base * 2, base * 4, base * 8, base * 10]
        self.enc = nn.ModuleList()
        prev = in_ch
        for c in chs:
            self.enc.append(ConvBlock(prev, c))
            prev = c
        self.pool = nn.MaxPool3d(2)
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        for i in range(len(chs) - 1, 0, -1):
            self.up.append(nn.ConvTranspose3d(chs[i], chs[i - 1], 2, stride=2))
            self.dec.append(ConvBlock(chs[i - 1] * 2, chs[i - 1]))
        self.head = nn.Conv3d(chs[0], out_ch, 1)

    def forward(self, x):
        skips = []
        for i, blk in enumerate(self.enc):
            x = blk(x)
            if i < len(self.enc) - 1:
                skips.append(x)
                x = self.pool(x)
        for up, dec in zip(self.up, self.dec):
            x = up(x)
            x = dec(torch.cat([x, skips.pop()], dim=1))
        return self.head(x)


# ----------------------------------------------------------------------------- utils
def is_main():
    return dist.get_rank() == 0


def log(msg):
    if is_main():
        print(time.strftime("%H:%M:%S"), msg, flush=True)


def dice_per_channel(pred, target, eps=1e-5):
    # pred, target: (C, H, W, D) binary
    dims = (1, 2, 3)
    inter = (pred * target).sum(dims)
    denom = pred.sum(dims) + target.sum(dims)
    return (2 * inter + eps) / (denom + eps)


@torch.no_grad()
def validate(net, files, roi, device, rank, world_size):
    net.eval()
    my_files = files[rank::world_size]
    ds = BratsNpzDataset(my_files, train=False)
    dice_sum = torch.zeros(3, device=device)
    count = torch.zeros(1, device=device)
    for i in range(len(ds)):
        img, lab = ds[i]
        img = img.unsqueeze(0).to(device)
        lab = lab.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = sliding_window_inference(img, roi_size=roi, sw_batch_size=4, predictor=net, overlap=0.5)
        pred = (torch.sigmoid(logits[0].float()) > 0.5).float()
        dice_sum += dice_per_channel(pred, lab)
        count += 1
    dist.all_reduce(dice_sum)
    dist.all_reduce(count)
    net.train()
    return (dice_sum / count.clamp(min=1)).cpu().numpy()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    os.makedirs(args.out_dir, exist_ok=True)
    train_files, val_files = load_split(args.split_json, args.data_dir)
    log(f"{len(train_files)} train / {len(val_files)} val cases, world size {world_size}")

    train_ds = BratsNpzDataset(train_files, roi=args.roi, train=True)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, persistent_workers=True)

    model = UNet3D(in_ch=4, out_ch=3, base=args.base_ch).to(device)
    model = DDP(model, device_ids=[local_rank])

    loss_fn = DiceCELoss(sigmoid=True, smooth_nr=1e-5, smooth_dr=1e-5)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    best_dice = -1.0
    history = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run_loss = torch.zeros(2, device=device)
        for img, lab in loader:
            img = img.to(device, non_blocking=True)
            lab = lab.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                out = model(img)
                loss = loss_fn(out, lab)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            run_loss[0] += loss.detach()
            run_loss[1] += 1
        sched.step()
        dist.all_reduce(run_loss)
        ep_loss = (run_loss[0] / run_loss[1]).item()
        log(f"epoch {epoch:03d} loss {ep_loss:.4f} lr {sched.get_last_lr()[0]:.2e} ({time.time() - t0:.0f}s)")
        rec = {"epoch": epoch, "loss": ep_loss}

        if (epoch + 1) % args.val_every == 0 or epoch == args.epochs - 1:
            d = validate(model.module, val_files, args.roi, device, rank, world_size)
            mean_d = float(d.mean())
            rec.update({"dice_tc": float(d[0]), "dice_wt": float(d[1]), "dice_et": float(d[2]), "dice": mean_d})
            log(f"  val dice TC {d[0]:.4f} WT {d[1]:.4f} ET {d[2]:.4f} mean {mean_d:.4f}")
            if is_main() and mean_d > best_dice:
                best_dice = mean_d
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "dice": mean_d},
                           os.path.join(args.out_dir, "best.pt"))
        if is_main():
            history.append(rec)
            with open(os.path.join(args.out_dir, "history.json"), "w") as f:
                json.dump(history, f, indent=1)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out_dir, "last.pt"))
        dist.barrier()

    log(f"done, best mean dice {best_dice:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
