"""DeepLabV3+ (ResNeSt-50 via timm) with a boundary branch, Mapillary Vistas v1.2 (65 classes).

The boundary branch predicts semantic edges from the low-level + decoder
features; its loss weight is an ablation knob (--boundary-weight).

    torchrun --nproc_per_node=8 14_mapillary_dlv3p_boundary.py --root /datasets/mapillary
"""
import argparse
import json
import os
import random
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

IGNORE = 65  # "unlabeled" in Vistas v1.2


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/datasets/mapillary")
    ap.add_argument("--work-dir", default="work_dirs/dlv3p_s50_vistas")
    ap.add_argument("--crop", type=int, default=1024)
    ap.add_argument("--short-side", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--iters", type=int, default=120000)
    ap.add_argument("--boundary-weight", type=float, default=0.0)
    ap.add_argument("--eval-interval", type=int, default=10000)
    return ap.parse_args()


class Vistas(Dataset):
    mean = np.array([0.485, 0.456, 0.406], np.float32) * 255
    std = np.array([0.229, 0.224, 0.225], np.float32) * 255

    def __init__(self, root, split, crop, short_side, train):
        d = "training" if split == "train" else "validation"
        self.img_dir, self.lbl_dir = f"{root}/{d}/images", f"{root}/{d}/labels"
        self.names = sorted(f[:-4] for f in os.listdir(self.img_dir))
        self.crop, self.short, self.train = crop, short_side, train

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        img = Image.open(f"{self.img_dir}/{self.names[i]}.jpg").convert("RGB")
        lbl = Image.open(f"{self.lbl_dir}/{self.names[i]}.png")
        w, h = img.size
        s = self.short / min(w, h) * (random.uniform(0.5, 2.0) if self.train else 1.0)
        size = (int(w * s + 0.5), int(h * s + 0.5))
        img = np.asarray(img.resize(size, Image.BILINEAR), np.float32)
        lbl = np.asarray(lbl.resize(size, Image.NEAREST), np.int64)
        if self.train:
            ph, pw = max(self.crop - lbl.shape[0], 0), max(self.crop - lbl.shape[1], 0)
            img = np.pad(img, ((0, ph), (0, pw), (0, 0)))
            lbl = np.pad(lbl, ((0, ph), (0, pw)), constant_values=IGNORE)
            y, x = random.randint(0, lbl.shape[0] - self.crop), random.randint(0, lbl.shape[1] - self.crop)
            img, lbl = img[y:y + self.crop, x:x + self.crop], lbl[y:y + self.crop, x:x + self.crop]
            if random.random() < 0.5:
                img, lbl = img[:, ::-1], lbl[:, ::-1]
        img = (img - self.mean) / self.std
        return torch.from_numpy(img.transpose(2, 0, 1).copy()), torch.from_numpy(lbl.copy())


def semantic_edges(lbl, radius=2):
    """Binary boundary map from a label map (B,H,W) -> (B,1,H,W) float."""
    x = lbl[:, None].float()
    k = 2 * radius + 1
    mx = F.max_pool2d(x, k, 1, radius)
    mn = -F.max_pool2d(-x, k, 1, radius)
    return (mx != mn).float()


class ASPP(nn.Module):
    def __init__(self, cin, cout=256, rates=(6, 12, 18)):
        super().__init__()
        def branch(k, r):
            return nn.Sequential(nn.Conv2d(cin, cout, k, padding=0 if k == 1 else r, dilation=r, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU(True))
        self.branches = nn.ModuleList([branch(1, 1)] + [branch(3, r) for r in rates])
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(cin, cout, 1, bias=False),
                                  nn.BatchNorm2d(cout), nn.ReLU(True))
        self.project = nn.Sequential(nn.Conv2d(cout * 5, cout, 1, bias=False), nn.BatchNorm2d(cout),
                                     nn.ReLU(True), nn.Dropout(0.1))

    def forward(self, x):
        outs = [b(x) for b in self.branches]
        outs.append(F.interpolate(self.pool(x), size=x.shape[-2:], mode="bilinear", align_corners=False))
        return self.project(torch.cat(outs, 1))


class DeepLabV3PlusBoundary(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.backbone = timm.create_model("resnest50d", pretrained=True, features_only=True,
                                          out_indices=(1, 4), output_stride=16)
        c_low, c_high = self.backbone.feature_info.channels()
        self.aspp = ASPP(c_high)
        self.low = nn.Sequential(nn.Conv2d(c_low, 48, 1, bias=False), nn.BatchNorm2d(48), nn.ReLU(True))
        self.fuse = nn.Sequential(nn.Conv2d(304, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True),
                                  nn.Conv2d(256, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True))
        self.cls = nn.Conv2d(256, num_classes, 1)
        self.boundary = nn.Sequential(nn.Conv2d(256 + 48, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64),
                                      nn.ReLU(True), nn.Conv2d(64, 1, 1))

    def forward(self, x):
        low, high = self.backbone(x)
        low = self.low(low)
        y = F.interpolate(self.aspp(high), size=low.shape[-2:], mode="bilinear", align_corners=False)
        y = self.fuse(torch.cat([y, low], 1))
        seg = F.interpolate(self.cls(y), size=x.shape[-2:], mode="bilinear", align_corners=False)
        if not self.training:
            return seg
        edge = F.interpolate(self.boundary(torch.cat([y, low], 1)), size=x.shape[-2:],
                             mode="bilinear", align_corners=False)
        return seg, edge


@torch.no_grad()
def evaluate(net, loader, n, device):
    net.eval()
    hist = torch.zeros(n * n, device=device, dtype=torch.int64)
    for img, lbl in loader:
        img, lbl = img.to(device), lbl.to(device)
        pred = net(img).argmax(1)
        k = lbl != IGNORE
        hist += torch.bincount(lbl[k] * n + pred[k], minlength=n * n)
    dist.all_reduce(hist)
    h = hist.view(n, n).double()
    net.train()
    return h.diag() / (h.sum(0) + h.sum(1) - h.diag())


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    random.seed(1000 + rank)
    torch.manual_seed(1000)

    with open(os.path.join(args.root, "config_v1.2.json")) as f:
        labels = [l["readable"] for l in json.load(f)["labels"]][:IGNORE]
    n_cls = len(labels)

    train_ds = Vistas(args.root, "train", args.crop, args.short_side, True)
    val_ds = Vistas(args.root, "val", args.crop, args.short_side, False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, args.batch, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), 1, num_workers=3)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(DeepLabV3PlusBoundary(n_cls)).to(dev)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    head = [p for n, p in net.named_parameters() if not n.startswith("backbone.")]
    body = [p for n, p in net.named_parameters() if n.startswith("backbone.")]
    optimizer = torch.optim.SGD([{"params": body, "lr": args.lr}, {"params": head, "lr": args.lr * 10}],
                                momentum=0.9, weight_decay=1e-4)
    base_lrs = [args.lr, args.lr * 10]
    ce = nn.CrossEntropyLoss(ignore_index=IGNORE)

    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        print(f"{n_cls} classes, {len(train_ds)} train, {len(val_ds)} val, boundary w={args.boundary_weight}")

    it, ep, best = 0, 0, 0.0
    t0 = time.time()
    while it < args.iters:
        sampler.set_epoch(ep)
        for img, lbl in loader:
            for g, b in zip(optimizer.param_groups, base_lrs):
                g["lr"] = b * (1 - it / args.iters) ** 0.9
            img, lbl = img.to(dev, non_blocking=True), lbl.to(dev, non_blocking=True)
            seg, edge = model(img)
            loss = ce(seg, lbl)
            if args.boundary_weight > 0:
                tgt = semantic_edges(lbl)
                pos = tgt.mean().clamp(1e-3, 1 - 1e-3)
                bce = F.binary_cross_entropy_with_logits(edge, tgt, pos_weight=(1 - pos) / pos)
                loss = loss + args.boundary_weight * bce
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            it += 1
            if rank == 0 and it % 50 == 0:
                print(f"it {it} loss {loss.item():.4f} lr {optimizer.param_groups[0]['lr']:.2e} "
                      f"{(time.time() - t0) / 50:.2f}s/it", flush=True)
                t0 = time.time()
            if it % args.eval_interval == 0 or it == args.iters:
                iou = evaluate(net, val_loader, n_cls, dev)
                miou = torch.nanmean(iou).item()
                if rank == 0:
                    print(f"it {it} mIoU {100 * miou:.2f}", flush=True)
                    torch.save({"model": net.state_dict(), "it": it, "optimizer": optimizer.state_dict()},
                               os.path.join(args.work_dir, "latest.pth"))
                    if miou > best:
                        best = miou
                        torch.save({"model": net.state_dict(), "it": it}, os.path.join(args.work_dir, "best.pth"))
                dist.barrier()
            if it >= args.iters:
                break
        ep += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
