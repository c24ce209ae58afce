"""Spiking CenterNet detector on Prophesee Gen1 (cars / pedestrians).

Input: 50 ms windows as 5-bin polarity histograms, padded 240x304 -> 256x320.
The spiking backbone runs one bin per time step; the CenterNet head reads the
time-averaged spike features at stride 4. COCO mAP is computed on rank 0 from
the detections of all ranks.

    torchrun --nproc_per_node=8 16_gen1_spiking_centernet.py --root /data/gen1_prep --out runs/gen1_scn
"""
import argparse
import glob
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

H, W, PAD_H, PAD_W, STRIDE, NUM_CLASSES = 240, 304, 256, 320, 4, 2


class Gen1Windows(Dataset):
    def __init__(self, root, split):
        self.files = sorted(glob.glob(os.path.join(root, split, "*.npz")))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        hist = torch.from_numpy(d["hist"].astype(np.float32))  # [5, 2, 240, 304]
        hist = F.pad(torch.log1p(hist), (0, PAD_W - W, 0, PAD_H - H))
        boxes = torch.from_numpy(d["boxes"].astype(np.float32)).reshape(-1, 5)  # x, y, w, h, cls
        return hist, boxes, i


def collate(batch):
    return torch.stack([b[0] for b in batch]), [b[1] for b in batch], torch.tensor([b[2] for b in batch])


def gaussian_radius(h, w, min_overlap=0.7):
    a, b, c = 1, h + w, w * h * (1 - min_overlap) / (1 + min_overlap)
    return max(0, int((b + math.sqrt(b ** 2 - 4 * a * c)) / 2 / 2))


def build_targets(boxes_list, device):
    B, oh, ow = len(boxes_list), PAD_H // STRIDE, PAD_W // STRIDE
    hm = torch.zeros(B, NUM_CLASSES, oh, ow)
    wh = torch.zeros(B, 2, oh, ow)
    off = torch.zeros(B, 2, oh, ow)
    mask = torch.zeros(B, oh, ow)
    ys, xs = torch.meshgrid(torch.arange(oh), torch.arange(ow), indexing="ij")
    for b, boxes in enumerate(boxes_list):
        for x, y, w, h, c in boxes.tolist():
            cx, cy = (x + w / 2) / STRIDE, (y + h / 2) / STRIDE
            ix, iy = min(int(cx), ow - 1), min(int(cy), oh - 1)
            r = max(1, gaussian_radius(h / STRIDE, w / STRIDE))
            g = torch.exp(-((xs - ix) ** 2 + (ys - iy) ** 2) / (2 * (r / 3) ** 2))
            hm[b, int(c)] = torch.maximum(hm[b, int(c)], g)
            wh[b, :, iy, ix] = torch.tensor([w, h]) / STRIDE
            off[b, :, iy, ix] = torch.tensor([cx - ix, cy - iy])
            mask[b, iy, ix] = 1
    return hm.to(device), wh.to(device), off.to(device), mask.to(device)


class Spike(torch.autograd.Function):
    @staticmethod
    def forward(ctx, v):
        ctx.save_for_backward(v)
        return (v > 0).to(v.dtype)

    @staticmethod
    def backward(ctx, g):
        (v,) = ctx.saved_tensors
        return g * torch.exp(-v.pow(2) / 0.5) / math.sqrt(math.pi * 0.5)  # gaussian surrogate


class LIFConv(nn.Module):
    def __init__(self, cin, cout, stride, tau=2.0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.k = 1.0 / tau

    def forward(self, x_seq):  # [T, B, C, H, W]
        T, B = x_seq.shape[:2]
        cur = self.bn(self.conv(x_seq.flatten(0, 1)))
        cur = cur.view(T, B, *cur.shape[1:])
        v, out = torch.zeros_like(cur[0]), []
        for t in range(T):
            v = v + self.k * (cur[t] - v)
            s = Spike.apply(v - 1.0)
            v = v * (1 - s)
            out.append(s)
        return torch.stack(out)


class SpikingCenterNet(nn.Module):
    def __init__(self, c=(32, 64, 128, 256)):
        super().__init__()
        self.s1 = nn.Sequential(LIFConv(2, c[0], 2), LIFConv(c[0], c[0], 1))
        self.s2 = nn.Sequential(LIFConv(c[0], c[1], 2), LIFConv(c[1], c[1], 1))
        self.s3 = nn.Sequential(LIFConv(c[1], c[2], 2), LIFConv(c[2], c[2], 1))
        self.s4 = nn.Sequential(LIFConv(c[2], c[3], 2), LIFConv(c[3], c[3], 1))
        self.lat3 = nn.Conv2d(c[2], 128, 1)
        self.lat4 = nn.Conv2d(c[3], 128, 1)
        self.lat2 = nn.Conv2d(c[1], 128, 1)

        def head(out):
            return nn.Sequential(nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(128, out, 1))
        self.hm, self.wh, self.off = head(NUM_CLASSES), head(2), head(2)
        self.hm[-1].bias.data.fill_(-2.19)

    def forward(self, x):  # x [B, T, 2, H, W]
        x = x.transpose(0, 1)
        f2 = self.s2(self.s1(x))
        f3 = self.s3(f2)
        f4 = self.s4(f3)
        f2, f3, f4 = f2.mean(0), f3.mean(0), f4.mean(0)  # firing rates
        p = self.lat4(f4)
        p = self.lat3(f3) + F.interpolate(p, scale_factor=2, mode="nearest")
        p = self.lat2(f2) + F.interpolate(p, scale_factor=2, mode="nearest")
        return self.hm(p), self.wh(p), self.off(p)


def focal_loss(pred, gt):
    p = pred.sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = gt.eq(1).float()
    neg = 1 - pos
    pos_l = (torch.log(p) * (1 - p) ** 2 * pos).sum()
    neg_l = (torch.log(1 - p) * p ** 2 * (1 - gt) ** 4 * neg).sum()
    return -(pos_l + neg_l) / pos.sum().clamp(min=1)


@torch.no_grad()
def decode(hm, wh, off, idx, k=100, thresh=0.05):
    hm = hm.sigmoid()
    keep = (F.max_pool2d(hm, 3, 1, 1) == hm).float()
    B, C, oh, ow = hm.shape
    scores, inds = (hm * keep).view(B, -1).topk(k)
    cls = inds // (oh * ow)
    pix = inds % (oh * ow)
    ys, xs = (pix // ow).float(), (pix % ow).float()
    dets = []
    for b in range(B):
        m = scores[b] > thresh
        p = pix[b][m]
        w_ = wh[b, 0].flatten()[p] * STRIDE
        h_ = wh[b, 1].flatten()[p] * STRIDE
        cx = (xs[b][m] + off[b, 0].flatten()[p]) * STRIDE
        cy = (ys[b][m] + off[b, 1].flatten()[p]) * STRIDE
        img = torch.full_like(cx, float(idx[b]))
        dets.append(torch.stack([img, cx - w_ / 2, cy - h_ / 2, w_, h_, scores[b][m], cls[b][m].float()], 1))
    return torch.cat(dets)


def gather_tensor(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out)


def coco_map(dets, gts):
    images = [{"id": int(i), "height": H, "width": W} for i in sorted(set(gts[:, 0].long().tolist()))]
    anns = [{"id": n + 1, "image_id": int(g[0]), "bbox": g[1:5].tolist(), "area": float(g[3] * g[4]),
             "category_id": int(g[5]), "iscrowd": 0} for n, g in enumerate(gts)]
    gt = COCO()
    gt.dataset = {"images": images, "annotations": anns, "categories": [{"id": 0}, {"id": 1}]}
    gt.createIndex()
    if len(dets) == 0:
        return 0.0
    dt = gt.loadRes([{"image_id": int(d[0]), "bbox": d[1:5].tolist(), "score": float(d[5]),
                      "category_id": int(d[6])} for d in dets])
    ev = COCOeval(gt, dt, "bbox")
    ev.evaluate(), ev.accumulate(), ev.summarize()
    return ev.stats[0]


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    dets, gts = [], []
    for x, boxes, idx in loader:
        hm, wh, off = net(x.to(device, non_blocking=True))
        dets.append(decode(hm, wh, off, idx))
        for b, bx in zip(idx.tolist(), boxes):
            gts.append(torch.cat([torch.full((len(bx), 1), float(b)), bx], 1))
    dets = gather_tensor(torch.cat(dets))
    gts = gather_tensor(torch.cat(gts).to(device))
    if dist.get_rank() == 0:
        return coco_map(dets.cpu().numpy(), gts.cpu().numpy())
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="runs/gen1_scn")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=2)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set, val_set = Gen1Windows(args.root, "train"), Gen1Windows(args.root, "val")
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, collate_fn=collate,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), args.batch_size,
                            collate_fn=collate, num_workers=args.workers, pin_memory=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(SpikingCenterNet()).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs * len(train_loader))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    history = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (x, boxes, _) in enumerate(train_loader):
            x = x.to(device, non_blocking=True)
            hm_t, wh_t, off_t, mask = build_targets(boxes, device)
            hm, wh, off = model(x)
            m = mask.unsqueeze(1)
            l_hm = focal_loss(hm, hm_t)
            l_wh = (F.l1_loss(wh, wh_t, reduction="none") * m).sum() / m.sum().clamp(min=1)
            l_off = (F.l1_loss(off, off_t, reduction="none") * m).sum() / m.sum().clamp(min=1)
            loss = l_hm + 0.1 * l_wh + l_off
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 200 == 0:
                print(f"ep {epoch} it {it}/{len(train_loader)} hm {l_hm.item():.3f} wh {l_wh.item():.3f} "
                      f"off {l_off.item():.3f}", flush=True)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            mAP = evaluate(net, val_loader, device)
            if rank == 0:
                history.append({"epoch": epoch, "mAP": mAP})
                print(f"epoch {epoch}: val mAP {mAP:.4f} ({time.time() - tic:.0f}s)", flush=True)
                with open(os.path.join(args.out, "history.json"), "w") as f:
                    json.dump(history, f)
        if rank == 0:
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
