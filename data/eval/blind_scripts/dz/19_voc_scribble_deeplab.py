"""Scribble-supervised DeepLabV3+ (R-101) on PASCAL VOC 2012 (ScribbleSup annotations).

Partial cross-entropy on scribbled pixels only; unlabelled pixels are 255.
Evaluation uses the full VOC val masks.

    torchrun --nproc_per_node=4 19_voc_scribble_deeplab.py --voc /datasets/VOC2012 --scribbles /datasets/scribble_annotation/pascal_2012
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import resnet101, ResNet101_Weights
from torchvision.models._utils import IntermediateLayerGetter
from torchvision.models.segmentation.deeplabv3 import ASPP

NUM_CLASSES = 21
IGNORE = 255


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--voc", default="/datasets/VOC2012")
    ap.add_argument("--scribbles", default="/datasets/scribble_annotation/pascal_2012")
    ap.add_argument("--work-dir", default="work_dirs/scribble_dlv3p")
    ap.add_argument("--crop", type=int, default=321)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.007)
    ap.add_argument("--iters", type=int, default=30000)
    ap.add_argument("--eval-every", type=int, default=3000)
    return ap.parse_args()


class VOCScribble(Dataset):
    mean = np.array([0.485, 0.456, 0.406], np.float32)
    std = np.array([0.229, 0.224, 0.225], np.float32)

    def __init__(self, voc_root, label_dir, list_file, crop, train):
        with open(os.path.join(voc_root, "ImageSets/Segmentation", list_file)) as f:
            self.ids = f.read().split()
        self.voc_root, self.label_dir = voc_root, label_dir
        self.crop, self.train = crop, train

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img = Image.open(f"{self.voc_root}/JPEGImages/{self.ids[i]}.jpg").convert("RGB")
        lbl = Image.open(f"{self.label_dir}/{self.ids[i]}.png")
        if self.train:
            s = random.uniform(0.5, 1.5)
            size = (int(img.width * s), int(img.height * s))
            img, lbl = img.resize(size, Image.BILINEAR), lbl.resize(size, Image.NEAREST)
            img, lbl = np.asarray(img, np.float32) / 255, np.asarray(lbl, np.int64)
            ph, pw = max(self.crop - lbl.shape[0], 0), max(self.crop - lbl.shape[1], 0)
            img = np.pad(img, ((0, ph), (0, pw), (0, 0)))
            lbl = np.pad(lbl, ((0, ph), (0, pw)), constant_values=IGNORE)
            y, x = random.randint(0, lbl.shape[0] - self.crop), random.randint(0, lbl.shape[1] - self.crop)
            img, lbl = img[y:y + self.crop, x:x + self.crop], lbl[y:y + self.crop, x:x + self.crop]
            if random.random() < 0.5:
                img, lbl = img[:, ::-1], lbl[:, ::-1]
        else:
            img, lbl = np.asarray(img, np.float32) / 255, np.asarray(lbl, np.int64)
        img = (img - self.mean) / self.std
        return torch.from_numpy(img.transpose(2, 0, 1).copy()), torch.from_numpy(lbl.copy())


class DeepLabV3Plus(nn.Module):
    def __init__(self, n):
        super().__init__()
        r = resnet101(weights=ResNet101_Weights.IMAGENET1K_V2, replace_stride_with_dilation=[False, False, True])
        self.backbone = IntermediateLayerGetter(r, {"layer1": "low", "layer4": "high"})
        self.aspp = ASPP(2048, [6, 12, 18], 256)
        self.reduce = nn.Sequential(nn.Conv2d(256, 48, 1, bias=False), nn.BatchNorm2d(48), nn.ReLU(True))
        self.head = nn.Sequential(nn.Conv2d(304, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True),
                                  nn.Conv2d(256, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True),
                                  nn.Conv2d(256, n, 1))

    def forward(self, x):
        f = self.backbone(x)
        low = self.reduce(f["low"])
        high = F.interpolate(self.aspp(f["high"]), size=low.shape[-2:], mode="bilinear", align_corners=False)
        out = self.head(torch.cat([high, low], 1))
        return F.interpolate(out, size=x.shape[-2:], mode="bilinear", align_corners=False)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    hist = torch.zeros(NUM_CLASSES ** 2, dtype=torch.int64, device=device)
    for img, lbl in loader:
        img, lbl = img.to(device), lbl.to(device)
        pred = net(img).argmax(1)
        k = lbl != IGNORE
        hist += torch.bincount(lbl[k] * NUM_CLASSES + pred[k], minlength=NUM_CLASSES ** 2)
    dist.all_reduce(hist)
    h = hist.view(NUM_CLASSES, NUM_CLASSES).double()
    net.train()
    return torch.nanmean(h.diag() / (h.sum(0) + h.sum(1) - h.diag())).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(0)
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    train_ds = VOCScribble(args.voc, args.scribbles, "train_aug.txt", args.crop, True)
    val_ds = VOCScribble(args.voc, os.path.join(args.voc, "SegmentationClass"), "val.txt", args.crop, False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), 1, num_workers=2)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(DeepLabV3Plus(NUM_CLASSES)).to(device)
    model = DDP(net, device_ids=[local_rank])
    backbone = list(net.backbone.parameters())
    bb_ids = {id(p) for p in backbone}
    head = [p for p in net.parameters() if id(p) not in bb_ids]
    optimizer = torch.optim.SGD([{"params": backbone, "lr": args.lr}, {"params": head, "lr": args.lr * 10}],
                                momentum=0.9, weight_decay=5e-4)
    base_lrs = [args.lr, args.lr * 10]

    it, epoch, best, skipped = 0, 0, 0.0, 0
    t0 = time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for img, lbl in loader:
            if (lbl != IGNORE).sum() == 0:
                # random crop missed every scribble: partial CE would be NaN
                skipped += 1
                continue
            for g, b in zip(optimizer.param_groups, base_lrs):
                g["lr"] = b * (1 - it / args.iters) ** 0.9
            img, lbl = img.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
            loss = F.cross_entropy(model(img), lbl, ignore_index=IGNORE)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            it += 1
            if rank == 0 and it % 50 == 0:
                print(f"it {it} pCE {loss.item():.4f} skipped {skipped} {(time.time() - t0) / 50:.2f}s/it", flush=True)
                t0 = time.time()
            if it % args.eval_every == 0 or it == args.iters:
                miou = evaluate(net, val_loader, device)
                if rank == 0:
                    print(f"it {it} val mIoU {100 * miou:.2f}", flush=True)
                    torch.save({"model": net.state_dict(), "iter": it}, os.path.join(args.work_dir, "latest.pth"))
                    if miou > best:
                        best = miou
                        torch.save({"model": net.state_dict(), "iter": it}, os.path.join(args.work_dir, "best.pth"))
                dist.barrier()
            if it >= args.iters:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
