"""DeepGlobe 2018 land-cover classification (7 classes, 2448x2448 RGB tiles at 50 cm).

DeepLabV3+ / ResNet-101. Training uses random 1024 crops downscaled to 512; validation
tiles are predicted whole at 0.5 scale and upsampled back.

    torchrun --nproc_per_node=8 07_deepglobe_landcover.py --data /data/deepglobe_lc --wandb
"""
import argparse
import os
import time
from dataclasses import dataclass, asdict

import cv2
import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

# DeepGlobe colour code -> class id (unknown = 6 is ignored in the metric)
PALETTE = {
    (0, 255, 255): 0,    # urban
    (255, 255, 0): 1,    # agriculture
    (255, 0, 255): 2,    # rangeland
    (0, 255, 0): 3,      # forest
    (0, 0, 255): 4,      # water
    (255, 255, 255): 5,  # barren
    (0, 0, 0): 6,        # unknown
}
NUM_CLASSES = 6
IGNORE = 6


@dataclass
class Config:
    data: str = "/data/deepglobe_lc"
    out: str = "outputs/deepglobe_dlv3p"
    crop: int = 1024
    train_scale: float = 0.5
    batch_size: int = 8
    epochs: int = 100
    lr: float = 1e-3
    workers: int = 8
    wandb: bool = False


def parse() -> Config:
    cfg = Config()
    ap = argparse.ArgumentParser()
    for k, v in asdict(cfg).items():
        if isinstance(v, bool):
            ap.add_argument(f"--{k}", action="store_true")
        else:
            ap.add_argument(f"--{k}", type=type(v), default=v)
    return Config(**vars(ap.parse_args()))


def rgb_to_label(mask_rgb):
    lab = np.full(mask_rgb.shape[:2], IGNORE, dtype=np.uint8)
    # DeepGlobe masks are not perfectly binary after jpeg -> threshold first
    m = (mask_rgb >= 128).astype(np.uint8) * 255
    for color, cls in PALETTE.items():
        lab[np.all(m == np.array(color, dtype=np.uint8), axis=-1)] = cls
    return lab


class DeepGlobe(Dataset):
    def __init__(self, root, split, crop=None, scale=1.0):
        with open(os.path.join(root, f"{split}.txt")) as f:
            self.ids = [l.strip() for l in f if l.strip()]
        self.root, self.split, self.crop, self.scale = root, split, crop, scale

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        tid = self.ids[i]
        img = cv2.cvtColor(cv2.imread(os.path.join(self.root, "tiles", f"{tid}_sat.jpg")), cv2.COLOR_BGR2RGB)
        msk = cv2.cvtColor(cv2.imread(os.path.join(self.root, "tiles", f"{tid}_mask.png")), cv2.COLOR_BGR2RGB)
        lab = rgb_to_label(msk)
        if self.crop:
            h, w = lab.shape
            y, x = np.random.randint(0, h - self.crop + 1), np.random.randint(0, w - self.crop + 1)
            img, lab = img[y:y + self.crop, x:x + self.crop], lab[y:y + self.crop, x:x + self.crop]
            if np.random.rand() < 0.5:
                img, lab = img[:, ::-1], lab[:, ::-1]
            if np.random.rand() < 0.5:
                img, lab = img[::-1], lab[::-1]
        if self.scale != 1.0:
            img = cv2.resize(np.ascontiguousarray(img), None, fx=self.scale, fy=self.scale, interpolation=cv2.INTER_AREA)
            if self.crop:
                lab = cv2.resize(np.ascontiguousarray(lab), None, fx=self.scale, fy=self.scale,
                                 interpolation=cv2.INTER_NEAREST)
        img = (img.astype(np.float32) / 255.0 - np.array([0.485, 0.456, 0.406], np.float32)) / np.array(
            [0.229, 0.224, 0.225], np.float32)
        return torch.from_numpy(img.transpose(2, 0, 1).copy()), torch.from_numpy(lab.astype(np.int64).copy())


def confusion(pred, gt, n):
    keep = gt != IGNORE
    return np.bincount(n * gt[keep].astype(np.int64) + pred[keep], minlength=n * n).reshape(n, n)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    hist = np.zeros((NUM_CLASSES, NUM_CLASSES), dtype=np.int64)
    for img, lab in loader:
        img = img.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(img)
        logits = F.interpolate(logits.float(), size=lab.shape[-2:], mode="bilinear", align_corners=False)
        pred = logits.argmax(1).cpu().numpy()
        hist += confusion(pred.ravel(), lab.numpy().ravel(), NUM_CLASSES)
    hist = torch.from_numpy(hist)
    dist.all_reduce(hist, op=dist.ReduceOp.SUM)
    hist = hist.double()
    iou = hist.diag() / (hist.sum(0) + hist.sum(1) - hist.diag()).clamp(min=1)
    model.train()
    return iou.mean().item(), iou.tolist()


def main():
    cfg = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    run = None
    if is_main and cfg.wandb:
        import wandb
        run = wandb.init(project="deepglobe-landcover", config=asdict(cfg))

    train_ds = DeepGlobe(cfg.data, "train", crop=cfg.crop, scale=cfg.train_scale)
    val_ds = DeepGlobe(cfg.data, "val", crop=None, scale=0.5)
    val_ds.ids = val_ds.ids[rank::world]
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=1, shuffle=False, num_workers=4, pin_memory=True)

    model = smp.DeepLabV3Plus("resnet101", encoder_weights="imagenet", classes=NUM_CLASSES)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    enc_params = list(model.module.encoder.parameters())
    enc_ids = {id(p) for p in enc_params}
    dec_params = [p for p in model.parameters() if id(p) not in enc_ids]
    opt = torch.optim.SGD([{"params": enc_params, "lr": cfg.lr * 0.1}, {"params": dec_params, "lr": cfg.lr}],
                          momentum=0.9, weight_decay=1e-4)
    total_iters = cfg.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=total_iters, power=0.9)
    crit = nn.CrossEntropyLoss(ignore_index=IGNORE)
    scaler = torch.cuda.amp.GradScaler()

    if is_main:
        os.makedirs(cfg.out, exist_ok=True)
    best = 0.0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for img, lab in train_dl:
            img, lab = img.to(device, non_blocking=True), lab.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = crit(model(img), lab)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            tot += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        if (epoch + 1) % 5 == 0 or epoch == cfg.epochs - 1:
            miou, ious = validate(model.module, val_dl, device)
            if is_main:
                print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} mIoU {miou:.4f} "
                      f"{' '.join(f'{v:.3f}' for v in ious)} ({time.time() - t0:.0f}s)", flush=True)
                if run is not None:
                    run.log({"train/loss": (tot[0] / tot[1]).item(), "val/mIoU": miou, "epoch": epoch})
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "miou": miou},
                           os.path.join(cfg.out, "last.pth"))
                if miou > best:
                    best = miou
                    torch.save({"model": model.module.state_dict(), "epoch": epoch, "miou": miou},
                               os.path.join(cfg.out, "best.pth"))
        elif is_main:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} ({time.time() - t0:.0f}s)", flush=True)

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
