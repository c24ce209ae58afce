"""Defect segmentation U-Net for the glass-vial inspection station, trained on
DDP and exported to TorchScript for the line PC.

    torchrun --nproc_per_node=4 train_vial_seg.py --data /srv/vials/v3 --out /srv/vials/runs/unet_r18
"""
import argparse
import logging
import os
import random
import time
from pathlib import Path

import albumentations as A
import cv2
import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from albumentations.pytorch import ToTensorV2
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("vialseg")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--encoder", default="resnet18")
    ap.add_argument("--height", type=int, default=640)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--batch-size", type=int, default=32, help="global")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--pos-weight", type=float, default=5.0)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


class VialDataset(Dataset):
    """images/<split>/<id>.png, masks/<split>/<id>.png (all-zero mask for good vials)."""

    def __init__(self, root, split, tf):
        self.img_dir = Path(root) / "images" / split
        self.mask_dir = Path(root) / "masks" / split
        self.ids = sorted(p.stem for p in self.img_dir.glob("*.png"))
        self.tf = tf

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img = cv2.imread(str(self.img_dir / f"{self.ids[i]}.png"), cv2.IMREAD_COLOR)[..., ::-1]
        mp = self.mask_dir / f"{self.ids[i]}.png"
        mask = (cv2.imread(str(mp), cv2.IMREAD_GRAYSCALE) > 127) if mp.exists() else np.zeros(img.shape[:2], bool)
        out = self.tf(image=np.ascontiguousarray(img), mask=mask.astype(np.float32))
        return out["image"], out["mask"].unsqueeze(0)


def transforms(h, w, train):
    t = [A.Resize(h, w)]
    if train:
        t += [A.HorizontalFlip(), A.ShiftScaleRotate(0.05, 0.05, 5, border_mode=cv2.BORDER_REFLECT),
              A.RandomBrightnessContrast(0.15, 0.15), A.GaussNoise(var_limit=(5, 20), p=0.3)]
    return A.Compose(t + [A.Normalize(), ToTensorV2()])


def build_model(encoder, pretrained=True):
    return smp.Unet(encoder, encoder_weights="imagenet" if pretrained else None, classes=1)


class DiceBCE(nn.Module):
    def __init__(self, pos_weight):
        super().__init__()
        self.register_buffer("pw", torch.tensor([pos_weight]))

    def forward(self, logits, target):
        bce = F.binary_cross_entropy_with_logits(logits, target, pos_weight=self.pw)
        p = torch.sigmoid(logits)
        dice = 1 - (2 * (p * target).sum() + 1) / (p.sum() + target.sum() + 1)
        return bce + dice


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    img_y, img_s, inter, union = [], [], 0.0, 0.0
    for x, m in loader:
        x, m = x.to(device), m.to(device)
        p = torch.sigmoid(net(x))
        img_y += (m.flatten(1).amax(1) > 0).long().tolist()
        img_s += F.avg_pool2d(p, 7, 1, 3).flatten(1).amax(1).tolist()
        pred = p > 0.5
        inter += (pred & (m > 0)).sum().item()
        union += (pred | (m > 0)).sum().item()
    net.train()
    return {"image_auroc": roc_auc_score(img_y, img_s), "defect_iou": inter / max(union, 1.0)}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    seed = 2024
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    train_ds = VialDataset(args.data, "train", transforms(args.height, args.width, True))
    val_ds = VialDataset(args.data, "val", transforms(args.height, args.width, False))
    test_ds = VialDataset(args.data, "test", transforms(args.height, args.width, False))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size // world, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=16, num_workers=4)

    model = build_model(args.encoder)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    criterion = DiceBCE(args.pos_weight).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs, eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()

    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    best_iou = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for x, m in train_loader:
            x, m = x.to(device, non_blocking=True), m.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(x)
            loss = criterion(logits.float(), m)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(loss_acc)

        if rank == 0:
            metrics = validate(model.module, val_loader, device)
            log.info("epoch %d loss %.4f val img-AUROC %.4f IoU %.4f lr %.2e (%.0fs)", epoch,
                     (loss_acc[0] / loss_acc[1]).item(), metrics["image_auroc"], metrics["defect_iou"],
                     scheduler.get_last_lr()[0], time.time() - t0)
            if metrics["defect_iou"] > best_iou:
                best_iou = metrics["defect_iou"]
                torch.save(model.state_dict(), out / "best.pth")
                log.info("new best IoU %.4f", best_iou)
        dist.barrier()

    # ---- final test + TorchScript export of the best weights (rank 0) ----
    if rank == 0:
        net = build_model(args.encoder, pretrained=False)
        net.load_state_dict(torch.load(out / "best.pth", map_location="cpu"))
        net = net.to(device).eval()
        test_metrics = validate(net, DataLoader(test_ds, batch_size=16, num_workers=4), device)
        log.info("test img-AUROC %.4f IoU %.4f", test_metrics["image_auroc"], test_metrics["defect_iou"])
        example = torch.randn(1, 3, args.height, args.width, device=device)
        scripted = torch.jit.trace(net, example)
        scripted.save(str(out / "vial_unet_ts.pt"))
        log.info("exported %s", out / "vial_unet_ts.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
