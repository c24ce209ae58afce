"""Student-teacher feature pyramid anomaly detector (ResNet-18 teacher / student), DDP + AMP.

Reports image AUROC, pixel AUROC and PRO (integrated up to FPR 0.3) on the MVTec test split.

    torchrun --nproc_per_node=4 07_st_pyramid_eval.py --data /data/mvtec --category zipper --amp
"""
import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from skimage.measure import label as cc_label
from sklearn.metrics import auc, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.models import ResNet18_Weights, resnet18


class MVTecCategory(Dataset):
    def __init__(self, root, category, train, size=256):
        root = Path(root) / category
        split_dir = root / ("train" if train else "test")
        self.items = []
        for img in sorted(split_dir.glob("*/*.png")):
            gt = None if img.parent.name == "good" else root / "ground_truth" / img.parent.name / f"{img.stem}_mask.png"
            self.items.append((img, gt))
        self.img_tf = transforms.Compose([transforms.Resize((size, size)), transforms.ToTensor(),
                                          transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
        self.gt_tf = transforms.Compose([transforms.Resize((size, size), transforms.InterpolationMode.NEAREST),
                                         transforms.ToTensor()])
        self.size = size

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        img, gt = self.items[i]
        x = self.img_tf(Image.open(img).convert("RGB"))
        m = torch.zeros(1, self.size, self.size) if gt is None else (self.gt_tf(Image.open(gt)) > 0.5).float()
        return x, m, int(gt is not None)


def resnet18_pyramid(pretrained):
    net = resnet18(weights=ResNet18_Weights.IMAGENET1K_V1 if pretrained else None)
    return nn.ModuleList([
        nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, net.layer1),
        net.layer2,
        net.layer3,
    ])


class STPyramid(nn.Module):
    def __init__(self):
        super().__init__()
        self.teacher = resnet18_pyramid(pretrained=True)
        self.student = resnet18_pyramid(pretrained=False)
        for p in self.teacher.parameters():
            p.requires_grad = False

    def train(self, mode=True):
        super().train(mode)
        self.teacher.eval()
        return self

    @staticmethod
    def _run(stages, x):
        feats = []
        for stage in stages:
            x = stage(x)
            feats.append(x)
        return feats

    def forward(self, x):
        with torch.no_grad():
            t = self._run(self.teacher, x)
        s = self._run(self.student, x)
        return t, s

    @torch.no_grad()
    def anomaly_map(self, x):
        t, s = self.forward(x)
        amap = torch.ones(x.shape[0], 1, *x.shape[-2:], device=x.device)
        for ft, fs in zip(t, s):
            d = 0.5 * (F.normalize(ft.float(), dim=1) - F.normalize(fs.float(), dim=1)).pow(2).sum(1, keepdim=True)
            amap = amap * F.interpolate(d, size=x.shape[-2:], mode="bilinear", align_corners=False)
        return amap


def pyramid_loss(t, s):
    return sum(0.5 * (F.normalize(a, dim=1) - F.normalize(b, dim=1)).pow(2).sum(1).mean() for a, b in zip(t, s))


def compute_pro(masks, amaps, max_fpr=0.3, num_th=200):
    """Per-region overlap averaged over connected GT components, integrated up to max_fpr."""
    ths = np.linspace(amaps.min(), amaps.max(), num_th)
    pros, fprs = [], []
    regions = [(i, cc_label(m, connectivity=2)) for i, m in enumerate(masks)]
    inv = masks == 0
    for th in ths:
        binary = amaps > th
        overlaps = []
        for i, lab in regions:
            for r in range(1, lab.max() + 1):
                region = lab == r
                overlaps.append((binary[i] & region).sum() / region.sum())
        pros.append(np.mean(overlaps) if overlaps else 0.0)
        fprs.append((binary & inv).sum() / inv.sum())
    pros, fprs = np.array(pros), np.array(fprs)
    keep = fprs <= max_fpr
    order = np.argsort(fprs[keep])
    return auc(fprs[keep][order], pros[keep][order]) / max_fpr


def run_eval(model, loader, device):
    model.eval()
    amaps, masks, img_scores, labels = [], [], [], []
    for x, m, y in loader:
        amap = model.anomaly_map(x.to(device, non_blocking=True))
        amaps.append(amap.squeeze(1).cpu().numpy())
        masks.append(m.squeeze(1).numpy().astype(np.uint8))
        img_scores.append(amap.flatten(1).max(1).values.cpu().numpy())
        labels.append(y.numpy())
    model.train()
    amaps, masks = np.concatenate(amaps), np.concatenate(masks)
    return {
        "image_auroc": roc_auc_score(np.concatenate(labels), np.concatenate(img_scores)),
        "pixel_auroc": roc_auc_score(masks.ravel(), amaps.ravel()),
        "pro": compute_pro(masks, amaps),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/mvtec")
    ap.add_argument("--category", default="zipper")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.4, help="reference lr for 32 images per step")
    ap.add_argument("--amp", action="store_true")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--save", default="ckpt/st_pyramid")
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    train_ds = MVTecCategory(args.data, args.category, train=True, size=args.size)
    test_ds = MVTecCategory(args.data, args.category, train=False, size=args.size)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(test_ds, batch_size=8, shuffle=False, num_workers=4)

    model = STPyramid()
    model.student = nn.SyncBatchNorm.convert_sync_batchnorm(model.student)
    model = model.to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.bs * dist.get_world_size() / 32  # linear scaling with the global batch
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr,
                                momentum=0.9, weight_decay=1e-4)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    save_dir = Path(args.save) / args.category
    if rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)

    best_pro = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, loss_sum, n = time.time(), torch.zeros((), device=device), 0
        for x, _, _ in train_loader:
            x = x.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                t, s = model(x)
                loss = pyramid_loss(t, s)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            loss_sum += loss.detach()
            n += 1
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"[{args.category}] epoch {epoch + 1}/{args.epochs} loss {loss_sum.item() / n:.4f} "
                  f"({time.time() - t0:.1f}s)", flush=True)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            if rank == 0:
                metrics = run_eval(model, test_loader, device)
                print(f"[{args.category}] epoch {epoch + 1}: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()),
                      flush=True)
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "metrics": metrics},
                           save_dir / "last.pth")
                if metrics["pro"] > best_pro:
                    best_pro = metrics["pro"]
                    torch.save({"epoch": epoch, "model": model.module.state_dict(), "metrics": metrics},
                               save_dir / "best.pth")
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
