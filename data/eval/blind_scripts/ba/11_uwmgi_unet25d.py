# UW-Madison GI Tract Image Segmentation
# 2.5D (3 neighbouring slices as channels) smp.Unet, multilabel masks (large bowel, small bowel, stomach)
# torchrun --nproc_per_node=4 11_uwmgi_unet25d.py --encoder efficientnet-b4 --fold 0
import argparse
import os
import time

import albumentations as A
import cv2
import numpy as np
import pandas as pd
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--meta", default="/data/uwmgi/train_25d_folds.csv")
    p.add_argument("--encoder", default="efficientnet-b4")
    p.add_argument("--img-size", type=int, nargs=2, default=[320, 384])
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--bs", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--wd", type=float, default=1e-6)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--logdir", default="./tb/uwmgi")
    p.add_argument("--ckpt-dir", default="./ckpt/uwmgi")
    return p.parse_args()


class SliceDS(Dataset):
    """rows hold paths to a 3-slice .npy stack (H, W, 3, uint16) and a 3-class mask .npy (H, W, 3, uint8)."""

    def __init__(self, df, tfm):
        self.img_paths = df.image_path.values
        self.mask_paths = df.mask_path.values
        self.tfm = tfm

    def __len__(self):
        return len(self.img_paths)

    def __getitem__(self, i):
        img = np.load(self.img_paths[i]).astype(np.float32)
        mx = img.max()
        if mx > 0:
            img /= mx
        msk = np.load(self.mask_paths[i]).astype(np.float32)
        out = self.tfm(image=img, mask=msk)
        return torch.from_numpy(out["image"].transpose(2, 0, 1)), torch.from_numpy(out["mask"].transpose(2, 0, 1))


def transforms(size):
    train = A.Compose([
        A.Resize(*size, interpolation=cv2.INTER_NEAREST),
        A.HorizontalFlip(p=0.5),
        A.ShiftScaleRotate(shift_limit=0.0625, scale_limit=0.05, rotate_limit=10, p=0.5),
        A.OneOf([A.GridDistortion(num_steps=5, distort_limit=0.05), A.ElasticTransform(alpha=1, sigma=50)], p=0.25),
        A.CoarseDropout(max_holes=8, max_height=size[0] // 20, max_width=size[1] // 20, fill_value=0, p=0.5),
    ])
    valid = A.Compose([A.Resize(*size, interpolation=cv2.INTER_NEAREST)])
    return train, valid


class DiceBCE(nn.Module):
    def __init__(self):
        super().__init__()
        self.dice = smp.losses.DiceLoss(mode="multilabel")
        self.bce = smp.losses.SoftBCEWithLogitsLoss()

    def forward(self, logits, y):
        return 0.5 * self.dice(logits, y) + 0.5 * self.bce(logits, y)


@torch.no_grad()
def validate(model, loader, crit, device, thr=0.5):
    model.eval()
    acc = torch.zeros(4, 3, device=device, dtype=torch.float64)  # inter, pred_sum, true_sum, (loss, n, -)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            logits = model(x)
        acc[3, 0] += crit(logits.float(), y).item() * x.size(0)
        acc[3, 1] += x.size(0)
        p = (torch.sigmoid(logits.float()) > thr).float()
        acc[0] += (p * y).sum(dim=(0, 2, 3)).double()
        acc[1] += p.sum(dim=(0, 2, 3)).double()
        acc[2] += y.sum(dim=(0, 2, 3)).double()
    dist.all_reduce(acc)
    dice = (2 * acc[0] + 1e-6) / (acc[1] + acc[2] + 1e-6)
    return (acc[3, 0] / acc[3, 1]).item(), dice.cpu().numpy()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2022)
    writer = SummaryWriter(os.path.join(args.logdir, f"fold{args.fold}")) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    df = pd.read_csv(args.meta)
    trn, val = df[df.fold != args.fold].reset_index(drop=True), df[df.fold == args.fold].reset_index(drop=True)
    ttf, vtf = transforms(args.img_size)
    trn_ds, val_ds = SliceDS(trn, ttf), SliceDS(val, vtf)
    trn_sampler = DistributedSampler(trn_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    trn_dl = DataLoader(trn_ds, batch_size=args.bs, sampler=trn_sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    # strided, non-padded shard: every validation slice is counted exactly once in the all-reduced dice
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=args.bs * 2, shuffle=False,
                        num_workers=args.workers, pin_memory=True)

    model = smp.Unet(args.encoder, encoder_weights="imagenet", in_channels=3, classes=3)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(trn_dl), eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    crit = DiceBCE()

    best_dice, it = 0.0, 0
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for x, y in trn_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = crit(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
            it += 1
            if writer is not None and it % 50 == 0:
                writer.add_scalar("train/loss_step", loss.item(), it)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], it)
        dist.all_reduce(run)
        val_loss, dice = validate(model.module, val_dl, crit, device)
        mean_dice = float(dice.mean())

        if rank == 0:
            train_loss = (run[0] / run[1]).item()
            writer.add_scalar("train/loss", train_loss, epoch)
            writer.add_scalar("valid/loss", val_loss, epoch)
            writer.add_scalar("valid/dice", mean_dice, epoch)
            print(f"epoch {epoch} train {train_loss:.4f} valid {val_loss:.4f} dice lb/sb/st "
                  f"{dice[0]:.4f}/{dice[1]:.4f}/{dice[2]:.4f} mean {mean_dice:.4f} ({time.time() - t0:.0f}s)", flush=True)
            state = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": opt.state_dict(),
                     "scaler": scaler.state_dict(), "dice": mean_dice}
            torch.save(state, os.path.join(args.ckpt_dir, f"{args.encoder}_f{args.fold}_last.pth"))
            if mean_dice > best_dice:
                best_dice = mean_dice
                torch.save(model.module.state_dict(), os.path.join(args.ckpt_dir, f"{args.encoder}_f{args.fold}_best.pth"))
                print(f"  new best {best_dice:.4f}", flush=True)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
