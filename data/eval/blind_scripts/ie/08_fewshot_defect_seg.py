"""Semi-supervised defect segmentation for the weld-seam line.

Hundreds of nominal images plus a handful (10-30) of annotated defect images.
A shared encoder feeds a reconstruction decoder (trained on nominal images)
and a segmentation head (trained on the annotated defects). At test time the
defect map is seg probability + normalised reconstruction error.

    torchrun --nproc_per_node=4 weld_seg.py --root /data/weld --run-name weld_v5
"""
import argparse
import os
import random
import time
from pathlib import Path

import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import torchvision.transforms.functional as TF


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--run-name", required=True)
    p.add_argument("--out", default="/data/weld/runs")
    p.add_argument("--size", type=int, default=384)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=8, help="per GPU")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--defect-repeat", type=int, default=8, help="oversampling of the annotated defects")
    p.add_argument("--seg-weight", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


class WeldSet(Dataset):
    """Nominal images (mask all zero, is_defect=0) + annotated defects (is_defect=1)."""

    def __init__(self, root, split, size, defect_repeat=1, train=False):
        root = Path(root)
        items = [(f, None, 0) for f in sorted((root / split / "good").glob("*.png"))]
        defects = []
        for d in sorted((root / split).iterdir()):
            if d.name == "good" or not d.is_dir():
                continue
            for f in sorted(d.glob("*.png")):
                defects.append((f, root / "masks" / split / d.name / f"{f.stem}.png", 1))
        self.items = items + defects * defect_repeat
        self.size, self.train = size, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        f, m, y = self.items[i]
        img = Image.open(f).convert("RGB").resize((self.size, self.size), Image.BILINEAR)
        mask = Image.new("L", img.size) if m is None else Image.open(m).convert("L").resize(img.size, Image.NEAREST)
        if self.train:
            if random.random() < 0.5:
                img, mask = TF.hflip(img), TF.hflip(mask)
            if random.random() < 0.5:
                img, mask = TF.vflip(img), TF.vflip(mask)
            img = TF.adjust_brightness(img, random.uniform(0.85, 1.15))
        x = TF.normalize(TF.to_tensor(img), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        return x, (TF.to_tensor(mask) > 0.5).float(), y


class WeldNet(nn.Module):
    def __init__(self):
        super().__init__()
        base = smp.Unet("resnet34", encoder_weights="imagenet", classes=1)
        self.encoder = base.encoder
        self.seg_decoder = base.decoder
        self.seg_head = base.segmentation_head
        rec = smp.Unet("resnet34", encoder_weights=None, classes=3)
        self.rec_decoder = rec.decoder
        self.rec_head = rec.segmentation_head

    def forward(self, x, with_seg=True):
        feats = self.encoder(x)
        rec = self.rec_head(self.rec_decoder(*feats))
        seg = self.seg_head(self.seg_decoder(*feats)) if with_seg else None
        return rec, seg


def dice_loss(logits, target, eps=1.0):
    p = torch.sigmoid(logits)
    inter = (p * target).sum((1, 2, 3))
    return (1 - (2 * inter + eps) / (p.sum((1, 2, 3)) + target.sum((1, 2, 3)) + eps)).mean()


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    img_y, img_s, px_y, px_s = [], [], [], []
    for x, m, y in loader:
        x = x.to(device)
        rec, seg = net(x, with_seg=True)
        err = (rec - x).abs().mean(1, keepdim=True)
        err = err / (err.flatten(1).quantile(0.99, dim=1).view(-1, 1, 1, 1) + 1e-6)
        amap = torch.sigmoid(seg) + 0.5 * err.clamp(max=1)
        amap = F.avg_pool2d(amap, 9, 1, 4)
        img_y += y.tolist()
        img_s += amap.flatten(1).max(1).values.cpu().tolist()
        px_y.append(m.flatten().numpy())
        px_s.append(amap.flatten().cpu().numpy())
    net.train()
    px_y, px_s = np.concatenate(px_y), np.concatenate(px_s)
    return {"image_auroc": roc_auc_score(img_y, img_s), "pixel_auroc": roc_auc_score(px_y, px_s),
            "pixel_ap": average_precision_score(px_y, px_s)}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    out_dir = Path(args.out) / args.run_name
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)

    train_ds = WeldSet(args.root, "train", args.size, args.defect_repeat, train=True)
    val_ds = WeldSet(args.root, "val", args.size)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=4, num_workers=4)

    net = WeldNet()
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    net = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(loader), pct_start=0.05)

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        sums = torch.zeros(3, device=device)
        for x, m, is_defect in loader:
            x, m = x.to(device, non_blocking=True), m.to(device, non_blocking=True)
            is_defect = is_defect.to(device).bool()
            has_defect = bool(is_defect.any())

            rec, seg = net(x, with_seg=has_defect)
            w = (~is_defect).float().view(-1, 1, 1, 1)
            rec_loss = ((rec - x).abs() * w).sum() / (w.sum() * x[0].numel()).clamp_min(1.0)
            loss = rec_loss
            seg_loss = torch.zeros((), device=device)
            if has_defect:
                seg_loss = F.binary_cross_entropy_with_logits(seg, m) + dice_loss(seg[is_defect], m[is_defect])
                loss = loss + args.seg_weight * seg_loss

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            sums += torch.stack([rec_loss.detach(), seg_loss.detach(), torch.ones((), device=device)])

        dist.all_reduce(sums)
        if rank == 0:
            print(f"ep {epoch:3d} rec {sums[0] / sums[2]:.4f} seg {sums[1] / sums[2]:.4f} {time.time() - t0:.0f}s",
                  flush=True)
            if (epoch + 1) % 5 == 0:
                metrics = evaluate(net.module, val_loader, device)
                print(f"ep {epoch:3d} " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()), flush=True)
                ckpt = {"model": net.module.state_dict(), "epoch": epoch, "metrics": metrics, "args": vars(args)}
                torch.save(ckpt, out_dir / "last.pt")
                if metrics["pixel_ap"] > best:
                    best = metrics["pixel_ap"]
                    torch.save(ckpt, out_dir / "best.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
