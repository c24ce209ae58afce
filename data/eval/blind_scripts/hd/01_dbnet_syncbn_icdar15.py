#!/usr/bin/env python3
"""DBNet (ResNet-18 + FPN) text detection training on ICDAR2015 / MLT-style data.

Ground-truth shrink / threshold maps are generated offline by tools/make_db_maps.py
and stored next to the images as <name>.npz (keys: gt, mask, thresh_map, thresh_mask).

    torchrun --nproc_per_node=8 01_dbnet_syncbn_icdar15.py --data /data/icdar2015 --out runs/db_r18
"""
import argparse
import json
import os
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import resnet18


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/dbnet")
    p.add_argument("--epochs", type=int, default=1200)
    p.add_argument("--batch-size", type=int, default=4, help="images per GPU")
    p.add_argument("--lr", type=float, default=0.007)
    p.add_argument("--img-size", type=int, default=640)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--resume", default="")
    p.add_argument("--box-thresh", type=float, default=0.6)
    return p.parse_args()


class DBDataset(Dataset):
    def __init__(self, root, split, img_size):
        self.root = os.path.join(root, split)
        self.names = sorted(f[:-4] for f in os.listdir(self.root) if f.endswith(".jpg"))
        self.img_size = img_size
        self.train = split == "train"
        self.mean = np.array([0.485, 0.456, 0.406], dtype=np.float32)
        self.std = np.array([0.229, 0.224, 0.225], dtype=np.float32)

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        name = self.names[i]
        img = cv2.imread(os.path.join(self.root, name + ".jpg"))[:, :, ::-1]
        maps = np.load(os.path.join(self.root, name + ".npz"))
        gt, mask = maps["gt"], maps["mask"]
        tmap, tmask = maps["thresh_map"], maps["thresh_mask"]
        s = self.img_size
        if self.train and np.random.rand() < 0.5:
            img, gt, mask = img[:, ::-1], gt[:, ::-1], mask[:, ::-1]
            tmap, tmask = tmap[:, ::-1], tmask[:, ::-1]
        img = cv2.resize(np.ascontiguousarray(img), (s, s)).astype(np.float32) / 255.0
        img = (img - self.mean) / self.std
        rs = lambda m: cv2.resize(np.ascontiguousarray(m).astype(np.float32), (s, s), interpolation=cv2.INTER_NEAREST)
        return {
            "img": torch.from_numpy(img.transpose(2, 0, 1)),
            "gt": torch.from_numpy(rs(gt)), "mask": torch.from_numpy(rs(mask)),
            "thresh_map": torch.from_numpy(rs(tmap)), "thresh_mask": torch.from_numpy(rs(tmask)),
        }


class FPN(nn.Module):
    def __init__(self, in_chs=(64, 128, 256, 512), inner=256):
        super().__init__()
        self.lat = nn.ModuleList([nn.Conv2d(c, inner, 1, bias=False) for c in in_chs])
        self.smooth = nn.ModuleList([
            nn.Sequential(nn.Conv2d(inner, inner // 4, 3, padding=1, bias=False),
                          nn.BatchNorm2d(inner // 4), nn.ReLU(inplace=True)) for _ in in_chs])

    def forward(self, feats):
        lat = [l(f) for l, f in zip(self.lat, feats)]
        for i in range(len(lat) - 1, 0, -1):
            lat[i - 1] = lat[i - 1] + F.interpolate(lat[i], size=lat[i - 1].shape[-2:], mode="nearest")
        outs = [s(x) for s, x in zip(self.smooth, lat)]
        size = outs[0].shape[-2:]
        return torch.cat([F.interpolate(o, size=size, mode="nearest") for o in outs], 1)


def head(cin):
    return nn.Sequential(
        nn.Conv2d(cin, cin // 4, 3, padding=1, bias=False), nn.BatchNorm2d(cin // 4), nn.ReLU(inplace=True),
        nn.ConvTranspose2d(cin // 4, cin // 4, 2, 2), nn.BatchNorm2d(cin // 4), nn.ReLU(inplace=True),
        nn.ConvTranspose2d(cin // 4, 1, 2, 2), nn.Sigmoid())


class DBNet(nn.Module):
    def __init__(self, k=50):
        super().__init__()
        r = resnet18(weights="IMAGENET1K_V1")
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.layers = nn.ModuleList([r.layer1, r.layer2, r.layer3, r.layer4])
        self.neck = FPN()
        self.prob = head(256)
        self.thresh = head(256)
        self.k = k

    def forward(self, x):
        x = self.stem(x)
        feats = []
        for layer in self.layers:
            x = layer(x)
            feats.append(x)
        f = self.neck(feats)
        prob = self.prob(f)
        if not self.training:
            return prob
        thresh = self.thresh(f)
        binary = torch.reciprocal(1 + torch.exp(-self.k * (prob - thresh)))
        return prob, thresh, binary


def db_loss(prob, thresh, binary, b, ohem_ratio=3.0, eps=1e-6):
    gt, mask = b["gt"], b["mask"]
    pos = (gt * mask).bool()
    neg = ((1 - gt) * mask).bool()
    n_pos = int(pos.sum())
    n_neg = min(int(neg.sum()), int(n_pos * ohem_ratio))
    bce = F.binary_cross_entropy(prob.squeeze(1), gt, reduction="none")
    neg_loss, _ = bce[neg].topk(n_neg) if n_neg > 0 else (bce.new_zeros(0), None)
    l_prob = (bce[pos].sum() + neg_loss.sum()) / (n_pos + n_neg + eps)
    tm = b["thresh_mask"]
    l_thresh = (torch.abs(thresh.squeeze(1) - b["thresh_map"]) * tm).sum() / (tm.sum() + eps)
    bi = binary.squeeze(1)
    inter = (bi * gt * mask).sum()
    l_bin = 1 - 2 * inter / ((bi * mask).sum() + (gt * mask).sum() + eps)
    return l_prob + 10 * l_thresh + l_bin


def boxes_from_map(prob, thr=0.3, box_thresh=0.6):
    bitmap = (prob > thr).astype(np.uint8)
    contours, _ = cv2.findContours(bitmap, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
    boxes = []
    for c in contours[:1000]:
        x, y, w, h = cv2.boundingRect(c)
        if w < 3 or h < 3:
            continue
        if prob[y:y + h, x:x + w].mean() < box_thresh:
            continue
        boxes.append((x, y, x + w, y + h))
    return boxes


def iou(a, b):
    ix = max(0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / max(union, 1)


@torch.no_grad()
def evaluate(net, loader, device, box_thresh):
    net.eval()
    counts = torch.zeros(3, device=device)  # tp, n_pred, n_gt
    for b in loader:
        prob = net(b["img"].to(device, non_blocking=True)).squeeze(1).cpu().numpy()
        for p, g in zip(prob, b["gt"].numpy()):
            preds = boxes_from_map(p, box_thresh=box_thresh)
            gts = boxes_from_map(g, thr=0.5, box_thresh=0.0)
            matched = set()
            for pb in preds:
                for j, gb in enumerate(gts):
                    if j not in matched and iou(pb, gb) > 0.5:
                        matched.add(j)
                        break
            counts += torch.tensor([len(matched), len(preds), len(gts)], device=device, dtype=torch.float32)
    dist.all_reduce(counts)
    tp, npred, ngt = counts.tolist()
    p, r = tp / max(npred, 1), tp / max(ngt, 1)
    return p, r, 2 * p * r / max(p + r, 1e-6)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    train_set = DBDataset(args.data, "train", args.img_size)
    val_set = DBDataset(args.data, "test", args.img_size)
    # every rank gets a disjoint slice of the test images; no padding
    val_shard = Subset(val_set, list(range(rank, len(val_set), world)))
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_shard, batch_size=1, num_workers=2)

    model = DBNet()
    # 4 images per GPU is too few for per-GPU batch statistics
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optim = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    total_iters = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda it: (1 - it / total_iters) ** 0.9)

    start_epoch, best_hmean = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optim"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best_hmean = ckpt["epoch"] + 1, ckpt.get("best_hmean", 0.0)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    for epoch in range(start_epoch, args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        t0, running = time.time(), 0.0
        for it, b in enumerate(train_loader):
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            prob, thresh, binary = model(b["img"])
            loss = db_loss(prob, thresh, binary, b)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
            running += loss.item()
            if rank == 0 and it % 20 == 0:
                print(f"ep {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.5f}", flush=True)

        if rank == 0:
            print(f"epoch {epoch} mean loss {running / len(train_loader):.4f} ({time.time() - t0:.0f}s)")

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            p, r, h = evaluate(model.module, val_loader, device, args.box_thresh)
            if rank == 0:
                print(f"[eval] epoch {epoch} P {p:.4f} R {r:.4f} H {h:.4f}")
                state = {"model": model.module.state_dict(), "optim": optim.state_dict(),
                         "sched": sched.state_dict(), "epoch": epoch, "best_hmean": max(h, best_hmean)}
                torch.save(state, os.path.join(args.out, "last.pth"))
                if h > best_hmean:
                    torch.save(state, os.path.join(args.out, "best.pth"))
            best_hmean = max(h, best_hmean)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
