# SatMAE-style pretraining with grouped spectral channels on fMoW-Sentinel.
# Model code lives in models_mae_group_channels.py (copied from the SatMAE repo).
#
#   torchrun --nproc_per_node=8 08_satmae_group_channels.py \
#       --train_csv /data/fmow-sentinel/train.csv --output_dir /data/runs/satmae_gc_vitl --model vitl
import argparse
import json
import math
import os
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import rasterio
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

import models_mae_group_channels

# fMoW-Sentinel: 13 bands; B1, B9, B10 are dropped as in SatMAE
KEEP_BANDS = [1, 2, 3, 4, 5, 6, 7, 8, 11, 12]
GROUPS = ((0, 1, 2, 6), (3, 4, 5, 7), (8, 9))
MEAN = np.array([1184.4, 1120.8, 1136.3, 1263.7, 1645.4, 1846.9, 1762.6, 1972.6, 1732.2, 1247.9], np.float32)
STD = np.array([650.3, 712.1, 965.2, 948.9, 1108.1, 1258.7, 1233.6, 1364.4, 1310.4, 1087.6], np.float32)


def get_args():
    p = argparse.ArgumentParser("SatMAE group-channel pretraining")
    p.add_argument("--train_csv", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--model", default="vitl", choices=["vitb", "vitl"])
    p.add_argument("--input_size", type=int, default=96)
    p.add_argument("--patch_size", type=int, default=8)
    p.add_argument("--mask_ratio", type=float, default=0.75)
    p.add_argument("--spatial_mask", action="store_true", help="same mask across channel groups")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--warmup_epochs", type=int, default=5)
    p.add_argument("--blr", type=float, default=1e-4)
    p.add_argument("--weight_decay", type=float, default=0.05)
    p.add_argument("--num_workers", type=int, default=8)
    p.add_argument("--vis_every", type=int, default=2000)
    p.add_argument("--save_every", type=int, default=5)
    return p.parse_args()


class FMoWSentinel(Dataset):
    def __init__(self, csv_path, input_size):
        self.df = pd.read_csv(csv_path)
        self.root = os.path.dirname(csv_path)
        self.input_size = input_size

    def __len__(self):
        return len(self.df)

    def __getitem__(self, idx):
        path = os.path.join(self.root, self.df.iloc[idx]["image_path"])
        with rasterio.open(path) as src:
            img = src.read([b + 1 for b in KEEP_BANDS]).astype(np.float32)
        img = (img - MEAN[:, None, None]) / STD[:, None, None]
        img = torch.from_numpy(img)
        # random resized crop, kept simple: scale in [0.2, 1]
        _, h, w = img.shape
        s = np.random.uniform(0.2, 1.0)
        ch, cw = max(8, int(h * math.sqrt(s))), max(8, int(w * math.sqrt(s)))
        y0, x0 = np.random.randint(0, h - ch + 1), np.random.randint(0, w - cw + 1)
        img = img[:, y0:y0 + ch, x0:x0 + cw]
        img = torch.nn.functional.interpolate(img[None], size=(self.input_size, self.input_size),
                                              mode="bicubic", align_corners=False)[0]
        if np.random.rand() < 0.5:
            img = img.flip(-1)
        return img


def lr_at(epoch_float, args):
    if epoch_float < args.warmup_epochs:
        return args.lr * epoch_float / args.warmup_epochs
    t = (epoch_float - args.warmup_epochs) / (args.epochs - args.warmup_epochs)
    return args.lr * 0.5 * (1.0 + math.cos(math.pi * t))


def save_reconstruction(imgs, recon, mask, path):
    # false colour from the first group (B2, B3, B4 -> indices 0, 1, 2)
    def rgb(x):
        x = x[[2, 1, 0]].permute(1, 2, 0).cpu().numpy()
        lo, hi = np.percentile(x, 2), np.percentile(x, 98)
        return np.clip((x - lo) / (hi - lo + 1e-6), 0, 1)

    n = imgs.shape[0]
    fig, axes = plt.subplots(n, 3, figsize=(9, 3 * n))
    for i in range(n):
        axes[i, 0].imshow(rgb(imgs[i]))
        axes[i, 1].imshow(mask[i].cpu().numpy(), cmap="gray")
        axes[i, 2].imshow(rgb(recon[i]))
        for ax in axes[i]:
            ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0 + rank)
    np.random.seed(0 + rank)

    out = Path(args.output_dir)
    if rank == 0:
        (out / "vis").mkdir(parents=True, exist_ok=True)
    writer = SummaryWriter(str(out / "tb")) if rank == 0 else None

    dataset = FMoWSentinel(args.train_csv, args.input_size)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
                        pin_memory=True, drop_last=True)

    builder = {"vitb": models_mae_group_channels.mae_vit_base_patch16_dec512d8b,
               "vitl": models_mae_group_channels.mae_vit_large_patch16_dec512d8b}[args.model]
    model = builder(img_size=args.input_size, patch_size=args.patch_size, in_chans=len(KEEP_BANDS),
                    channel_groups=GROUPS, spatial_mask=args.spatial_mask, norm_pix_loss=True)
    model.to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])

    eff_batch = args.batch_size * world_size
    args.lr = args.blr * eff_batch / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    scaler = torch.cuda.amp.GradScaler()
    if rank == 0:
        print(f"base lr {args.blr:.2e} -> actual lr {args.lr:.2e} (eff. batch {eff_batch})")
        with open(out / "args.json", "w") as f:
            json.dump(vars(args), f, indent=2)

    global_step = 0
    iters = len(loader)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, imgs in enumerate(loader):
            lr = lr_at(epoch + it / iters, args)
            for g in optimizer.param_groups:
                g["lr"] = lr
            imgs = imgs.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss, pred, mask = model(imgs, mask_ratio=args.mask_ratio)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

            if rank == 0 and global_step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), global_step)
                writer.add_scalar("train/lr", lr, global_step)
            if rank == 0 and global_step % args.vis_every == 0:
                with torch.no_grad():
                    recon = model.unpatchify(pred[:4].float())
                    # mask is (N, G, L) for grouped channels -> show the first group on the patch grid
                    side = args.input_size // args.patch_size
                    m = mask[:4, 0].reshape(-1, side, side)
                    m = m.repeat_interleave(args.patch_size, 1).repeat_interleave(args.patch_size, 2)
                    save_reconstruction(imgs[:4].float(), recon, m, out / "vis" / f"step{global_step:07d}.png")
            global_step += 1

        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} time {time.time() - t0:.0f}s", flush=True)
            if (epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "scaler": scaler.state_dict(), "epoch": epoch, "args": vars(args)},
                           out / f"checkpoint-{epoch}.pth")
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
