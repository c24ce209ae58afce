"""Annual forest-loss segmentation from Landsat year-pair composites.

Each training sample is a 256x256 chip stacking the previous-year and the
current-year cloud-free composite (6 SR bands each, 12 channels) plus a loss
mask for that year:
    0 = stable forest, 1 = loss, 2 = non-forest, 255 = unknown

    torchrun --nproc_per_node=4 --master_port=29531 12_forest_loss_unet.py \
        --chips /data/shared/forest_loss/chips --years 2016 2017 2018 2019 2020
"""
import argparse
import glob
import os
import time

import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import confusion_matrix
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
import segmentation_models_pytorch as smp

CLASS_NAMES = ["stable_forest", "loss", "non_forest"]
N_CLASSES = 3
UNKNOWN = 255
SR_SCALE, SR_OFFSET = 2.75e-05, -0.2       # Landsat C2 L2 surface reflectance


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chips", required=True)
    ap.add_argument("--years", type=int, nargs="+", required=True)
    ap.add_argument("--val-tiles", nargs="+", default=["h18v08", "h21v09", "h11v10"],
                    help="ARD tiles held out for validation")
    ap.add_argument("--work-dir", default="/data/shared/forest_loss/work")
    ap.add_argument("--epochs", type=int, default=45)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--loss-weight", type=float, default=10.0, help="CE weight of the loss class")
    return ap.parse_args()


class YearPairChips(Dataset):
    def __init__(self, files, train):
        self.files, self.train = files, train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        f = self.files[idx]
        with rasterio.open(f) as src:
            arr = src.read().astype(np.float32)
        with rasterio.open(f.replace("_sr.tif", "_mask.tif")) as src:
            mask = src.read(1).astype(np.int64)
        x = np.clip(arr * SR_SCALE + SR_OFFSET, 0, 1)
        x = np.concatenate([x, x[6:] - x[:6]], 0)      # add the year-on-year difference
        if self.train:
            if np.random.rand() < 0.5:
                x, mask = x[:, ::-1], mask[::-1]
            if np.random.rand() < 0.5:
                x, mask = x[:, :, ::-1], mask[:, ::-1]
        return torch.from_numpy(x.copy()), torch.from_numpy(mask.copy())


def list_chips(root, years, tiles, exclude):
    files = []
    for y in years:
        for f in sorted(glob.glob(os.path.join(root, str(y), "*_sr.tif"))):
            tile = os.path.basename(f).split("_")[0]
            if (tile in tiles) != exclude:
                files.append(f)
    return files


def evaluate(model, loader, device):
    model.eval()
    cm = np.zeros((N_CLASSES, N_CLASSES), dtype=np.int64)
    with torch.no_grad():
        for x, y in loader:
            pred = model(x.to(device, non_blocking=True)).argmax(1).cpu().numpy().ravel()
            gt = y.numpy().ravel()
            keep = gt != UNKNOWN
            cm += confusion_matrix(gt[keep], pred[keep], labels=list(range(N_CLASSES)))
    cm = torch.from_numpy(cm)
    dist.all_reduce(cm, op=dist.ReduceOp.SUM)
    cm = cm.double()
    tp = cm.diag()
    iou = tp / (cm.sum(0) + cm.sum(1) - tp).clamp(min=1)
    prec = tp / cm.sum(0).clamp(min=1)
    rec = tp / cm.sum(1).clamp(min=1)
    return iou, prec, rec


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(3)

    train_files = list_chips(args.chips, args.years, args.val_tiles, exclude=True)
    val_files = list_chips(args.chips, args.years, args.val_tiles, exclude=False)
    train_set = YearPairChips(train_files, train=True)
    val_set = YearPairChips(val_files, train=False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, np.array_split(np.arange(len(val_set)), world)[rank]),
                            batch_size=args.batch_size, num_workers=4, pin_memory=True)

    model = smp.UnetPlusPlus("resnet50", encoder_weights=None, in_channels=18, classes=N_CLASSES)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    weights = torch.tensor([1.0, args.loss_weight, 1.0], device=device)
    ce = nn.CrossEntropyLoss(weight=weights, ignore_index=UNKNOWN)
    lovasz = smp.losses.LovaszLoss("multiclass", ignore_index=UNKNOWN)
    base_lr = args.lr * world
    optimizer = torch.optim.AdamW(model.parameters(), lr=base_lr, weight_decay=1e-4)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=base_lr, total_steps=total,
                                                    pct_start=0.1, div_factor=20)

    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        print(f"{len(train_set)} train chips, {len(val_set)} val chips, {world} GPUs", flush=True)

    best_loss_iou = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = ce(logits, y) + 0.3 * lovasz(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 100 == 0:
                print(f"[ep {epoch:02d} it {it:05d}] loss {loss.item():.4f}", flush=True)

        iou, prec, rec = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s): " + " | ".join(
                f"{n}: IoU {i:.3f} P {p:.3f} R {r:.3f}"
                for n, i, p, r in zip(CLASS_NAMES, iou.tolist(), prec.tolist(), rec.tolist())), flush=True)
            state = {"epoch": epoch, "model": model.module.state_dict(),
                     "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
            torch.save(state, os.path.join(args.work_dir, "latest.pth"))
            if iou[1] > best_loss_iou:
                best_loss_iou = iou[1].item()
                torch.save(state, os.path.join(args.work_dir, "best_loss_iou.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
