"""HRNetV2-W48 on Cityscapes (train fine), 1024x512 crops, OHEM cross-entropy.

    torchrun --nproc_per_node=4 09_cityscapes_hrnet_ohem.py --data /datasets/cityscapes --bs 3
"""
import argparse
import glob
import os
import random
import time

import cv2
import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

IGNORE = 255
NC = 19
CLASS_WEIGHT = [0.8373, 0.918, 0.866, 1.0345, 1.0166, 0.9969, 0.9754, 1.0489, 0.8786, 1.0023,
                0.9539, 0.9843, 1.1116, 0.9037, 1.0865, 1.0955, 1.0865, 1.1529, 1.0507]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/datasets/cityscapes")
    ap.add_argument("--out", default="output/hrnet_w48_cs")
    ap.add_argument("--bs", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=484)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--crop", type=int, nargs=2, default=[512, 1024], help="h w")
    ap.add_argument("--eval-epochs", type=int, default=20)
    ap.add_argument("--ohem-thresh", type=float, default=0.9)
    ap.add_argument("--ohem-keep", type=int, default=131072)
    return ap.parse_args()


class CityscapesCV2(Dataset):
    mean = np.array([0.485, 0.456, 0.406], np.float32)
    std = np.array([0.229, 0.224, 0.225], np.float32)

    def __init__(self, root, split, crop, train):
        self.imgs = sorted(glob.glob(os.path.join(root, "leftImg8bit", split, "*", "*.png")))
        self.crop, self.train = crop, train

    def __len__(self):
        return len(self.imgs)

    def __getitem__(self, i):
        p = self.imgs[i]
        img = cv2.imread(p, cv2.IMREAD_COLOR)[:, :, ::-1].astype(np.float32) / 255.0
        lbl = cv2.imread(p.replace("leftImg8bit", "gtFine", 1).replace("_leftImg8bit", "_gtFine_labelTrainIds"),
                         cv2.IMREAD_GRAYSCALE)
        if self.train:
            s = random.choice([0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0])
            img = cv2.resize(img, None, fx=s, fy=s, interpolation=cv2.INTER_LINEAR)
            lbl = cv2.resize(lbl, None, fx=s, fy=s, interpolation=cv2.INTER_NEAREST)
            ch, cw = self.crop
            ph, pw = max(ch - lbl.shape[0], 0), max(cw - lbl.shape[1], 0)
            if ph or pw:
                img = cv2.copyMakeBorder(img, 0, ph, 0, pw, cv2.BORDER_CONSTANT, value=(0, 0, 0))
                lbl = cv2.copyMakeBorder(lbl, 0, ph, 0, pw, cv2.BORDER_CONSTANT, value=IGNORE)
            y, x = random.randint(0, lbl.shape[0] - ch), random.randint(0, lbl.shape[1] - cw)
            img, lbl = img[y:y + ch, x:x + cw], lbl[y:y + ch, x:x + cw]
            if random.random() < 0.5:
                img, lbl = img[:, ::-1], lbl[:, ::-1]
        img = (img - self.mean) / self.std
        return torch.from_numpy(img.transpose(2, 0, 1).copy()), torch.from_numpy(lbl.astype(np.int64))


class HRNetSeg(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.backbone = timm.create_model("hrnet_w48", pretrained=True, features_only=True,
                                          feature_location="incre", out_indices=(1, 2, 3, 4))
        ch = sum(self.backbone.feature_info.channels())
        self.head = nn.Sequential(nn.Conv2d(ch, ch, 1, bias=False), nn.BatchNorm2d(ch), nn.ReLU(inplace=True),
                                  nn.Conv2d(ch, num_classes, 1))

    def forward(self, x):
        feats = self.backbone(x)
        size = feats[0].shape[-2:]
        y = torch.cat([feats[0]] + [F.interpolate(f, size, mode="bilinear", align_corners=False)
                                    for f in feats[1:]], 1)
        return F.interpolate(self.head(y), x.shape[-2:], mode="bilinear", align_corners=False)


class OhemCE(nn.Module):
    def __init__(self, thresh, min_kept, weight):
        super().__init__()
        self.thresh, self.min_kept = thresh, min_kept
        self.ce = nn.CrossEntropyLoss(weight=weight, ignore_index=IGNORE, reduction="none")

    def forward(self, logits, target):
        pixel_loss = self.ce(logits, target).view(-1)
        with torch.no_grad():
            prob = logits.softmax(1).gather(1, target.clamp(max=NC - 1).unsqueeze(1)).view(-1)
            valid = target.view(-1) != IGNORE
            prob = prob[valid]
            if prob.numel() == 0:
                return pixel_loss.sum() * 0
            k = min(self.min_kept, prob.numel() - 1)
            thr = max(prob.sort()[0][k].item(), self.thresh)
        keep = valid.clone()
        keep[valid] = prob < thr
        return pixel_loss[keep].mean() if keep.any() else pixel_loss.sum() * 0


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    hist = torch.zeros(NC, NC, dtype=torch.float64, device=device)
    for img, lbl in loader:
        img, lbl = img.to(device), lbl.to(device)
        logits = net(img) + net(img.flip(-1)).flip(-1)
        pred = logits.argmax(1)
        k = lbl != IGNORE
        hist += torch.bincount(lbl[k] * NC + pred[k], minlength=NC * NC).view(NC, NC).double()
    dist.all_reduce(hist)
    iou = hist.diag() / (hist.sum(1) + hist.sum(0) - hist.diag())
    net.train()
    return iou


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(304 + rank)
    np.random.seed(304 + rank)
    cv2.setNumThreads(0)

    train_set = CityscapesCV2(args.data, "train", tuple(args.crop), True)
    val_set = CityscapesCV2(args.data, "val", None, False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, list(range(rank, len(val_set), world))), batch_size=1,
                            num_workers=2, pin_memory=True)

    net = HRNetSeg(NC)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.SGD([{"params": filter(lambda p: p.requires_grad, net.parameters())}],
                                lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=False)
    criterion = OhemCE(args.ohem_thresh, args.ohem_keep, torch.tensor(CLASS_WEIGHT, device=device))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    total_iters = args.epochs * len(train_loader)
    cur, best = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        for i, (img, lbl) in enumerate(train_loader):
            lr = args.lr * (1 - cur / total_iters) ** 0.9
            optimizer.param_groups[0]["lr"] = lr
            img, lbl = img.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
            loss = criterion(model(img), lbl)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            cur += 1
            if rank == 0 and i % 100 == 0:
                print(f"Epoch [{epoch}/{args.epochs}] Iter [{i}/{len(train_loader)}] "
                      f"lr {lr:.6f} loss {loss.item():.4f} time {time.time() - tic:.1f}s", flush=True)

        if rank == 0 and ((epoch + 1) % args.eval_epochs == 0 or epoch + 1 == args.epochs):
            iou = evaluate(net, val_loader, device)
            miou = iou.mean().item()
            print(f"Epoch {epoch + 1}: mIoU {100 * miou:.2f}  per-class "
                  + " ".join(f"{100 * v:.1f}" for v in iou.tolist()), flush=True)
            torch.save({"epoch": epoch + 1, "state_dict": net.state_dict(), "optimizer": optimizer.state_dict()},
                       os.path.join(args.out, "checkpoint.pth.tar"))
            if miou > best:
                best = miou
                torch.save(net.state_dict(), os.path.join(args.out, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
