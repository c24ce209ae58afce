"""Deforestation (clear-cut) segmentation, Amazon, Sentinel-2 annual composites.

Input per chip: 10 bands for year t-1, 10 bands for year t, plus dNDVI -> 21 channels.
Labels come from PRODES polygons rasterised at 10 m.  Chips are grouped in
1-degree cells; cells listed in val_cells.txt are held out.

    torchrun --nproc_per_node=4 09_amazon_deforestation_seg.py \
        --chips /mnt/eo/prodes_chips --out /mnt/eo/runs/defor_v3
"""
import argparse
import logging
import os
import sys

import h5py
import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

S2_SCALE = 1e-4
IN_CH = 21


class ProdesChips(Dataset):
    """Reads chips from one HDF5 per 1-degree cell."""

    def __init__(self, chip_dir, cells, augment):
        self.index = []
        for cell in cells:
            path = os.path.join(chip_dir, f"{cell}.h5")
            with h5py.File(path, "r") as f:
                n = f["t0"].shape[0]
            self.index += [(path, k) for k in range(n)]
        self.augment = augment
        self._files = {}

    def __len__(self):
        return len(self.index)

    def _h5(self, path):
        if path not in self._files:
            self._files[path] = h5py.File(path, "r")
        return self._files[path]

    def __getitem__(self, i):
        path, k = self.index[i]
        f = self._h5(path)
        t0 = f["t0"][k].astype(np.float32) * S2_SCALE
        t1 = f["t1"][k].astype(np.float32) * S2_SCALE
        y = f["mask"][k].astype(np.float32)
        ndvi0 = (t0[6] - t0[2]) / (t0[6] + t0[2] + 1e-6)
        ndvi1 = (t1[6] - t1[2]) / (t1[6] + t1[2] + 1e-6)
        x = np.concatenate([t0, t1, (ndvi1 - ndvi0)[None]], 0)
        if self.augment:
            if np.random.rand() < 0.5:
                x, y = x[:, :, ::-1], y[:, ::-1]
            if np.random.rand() < 0.5:
                x, y = x[:, ::-1], y[::-1]
        return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())[None]


def read_cells(chip_dir):
    cells = sorted(os.path.splitext(f)[0] for f in os.listdir(chip_dir) if f.endswith(".h5"))
    with open(os.path.join(chip_dir, "val_cells.txt")) as f:
        val = {l.strip() for l in f if l.strip()}
    return [c for c in cells if c not in val], [c for c in cells if c in val]


def soft_dice_loss(logits, y):
    p = torch.sigmoid(logits)
    num = 2 * (p * y).sum() + 1.0
    den = p.sum() + y.sum() + 1.0
    return 1 - num / den


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    inter = union = 0
    loss_sum, n = 0.0, 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        loss_sum += F.binary_cross_entropy_with_logits(logits, y).item()
        n += 1
        p, t = logits > 0, y > 0.5
        inter += (p & t).sum().item()
        union += (p | t).sum().item()
    return inter / max(union, 1), loss_sum / max(n, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chips", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--arch", default="FPN", choices=["FPN", "Unet", "DeepLabV3Plus"])
    ap.add_argument("--encoder", default="resnext50_32x4d")
    ap.add_argument("--epochs", type=int, default=45)
    ap.add_argument("--batch-size", type=int, default=24, help="per GPU")
    ap.add_argument("--lr", type=float, default=4e-4, help="per GPU batch")
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.WARN,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    log = logging.getLogger("defor")

    train_cells, val_cells = read_cells(args.chips)
    train_ds = ProdesChips(args.chips, train_cells, augment=True)
    val_ds = ProdesChips(args.chips, val_cells, augment=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)
    log.info("%d train cells / %d chips, %d val cells / %d chips",
             len(train_cells), len(train_ds), len(val_cells), len(val_ds))

    Arch = getattr(smp, args.arch)
    model = Arch(args.encoder, encoder_weights=None, in_channels=IN_CH, classes=1)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr * world,
                                                    epochs=args.epochs, steps_per_epoch=len(train_loader))
    pos_weight = torch.tensor([2.0], device=device)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best_iou = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        seen, loss_acc = 0, torch.zeros((), device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            logits = logits.float()
            loss = F.binary_cross_entropy_with_logits(logits, y, pos_weight=pos_weight) + soft_dice_loss(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_acc += loss.detach()
            seen += 1
        dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)

        val_iou, val_loss = evaluate(model.module, val_loader, device)
        if rank == 0:
            log.info("epoch %02d train_loss %.4f val_loss %.4f val_IoU %.4f",
                     epoch, loss_acc.item() / seen, val_loss, val_iou)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "val_iou": val_iou,
                        "args": vars(args)}, os.path.join(args.out, "last.pt"))
            if val_iou > best_iou:
                best_iou = val_iou
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val_iou": val_iou,
                            "args": vars(args)}, os.path.join(args.out, "best.pt"))
                log.info("new best IoU %.4f", best_iou)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
