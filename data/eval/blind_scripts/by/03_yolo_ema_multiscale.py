"""Anchor-free YOLO-style detector, trained from scratch on a YOLO-format dataset.

    torchrun --nproc_per_node 4 train_yolo.py --data data/visdrone.yaml --epochs 300

Features: SyncBN, EMA, multi-scale training, AMP, label cache.
"""
import argparse
import math
import os
import random
import time
from contextlib import contextmanager
from copy import deepcopy
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchmetrics.detection import MeanAveragePrecision
from torchvision.ops import batched_nms, generalized_box_iou_loss

LOCAL_RANK = int(os.getenv("LOCAL_RANK", -1))
RANK = int(os.getenv("RANK", -1))
WORLD_SIZE = int(os.getenv("WORLD_SIZE", 1))


@contextmanager
def torch_distributed_zero_first(local_rank):
    """Let the local master do something (e.g. build a cache) while the others wait."""
    if local_rank not in (-1, 0):
        dist.barrier(device_ids=[local_rank])
    yield
    if local_rank == 0:
        dist.barrier(device_ids=[0])


# ------------------------------------------------------------------ data
class YoloDataset(Dataset):
    def __init__(self, img_dir, img_size=640, augment=False):
        self.img_files = sorted(p for p in Path(img_dir).rglob("*") if p.suffix.lower() in {".jpg", ".jpeg", ".png"})
        self.img_size = img_size
        self.augment = augment
        cache_path = Path(img_dir).with_suffix(".cache")
        if cache_path.exists():
            cache = np.load(cache_path, allow_pickle=True).item()
        else:
            cache = self._build_cache(cache_path)
        self.labels = [cache[str(f)] for f in self.img_files]

    def _build_cache(self, path):
        cache = {}
        for f in self.img_files:
            lb_file = Path(str(f).replace("/images/", "/labels/")).with_suffix(".txt")
            lb = np.zeros((0, 5), dtype=np.float32)
            if lb_file.exists():
                rows = [r.split() for r in lb_file.read_text().strip().splitlines() if r.strip()]
                if rows:
                    lb = np.array(rows, dtype=np.float32)
            cache[str(f)] = lb
        tmp = path.with_suffix(f".{os.getpid()}.npy")
        np.save(tmp, cache)
        os.replace(tmp, path)
        return cache

    def __len__(self):
        return len(self.img_files)

    def __getitem__(self, i):
        img = Image.open(self.img_files[i]).convert("RGB")
        w0, h0 = img.size
        r = self.img_size / max(w0, h0)
        nw, nh = int(round(w0 * r)), int(round(h0 * r))
        img = img.resize((nw, nh), Image.BILINEAR)
        canvas = np.full((self.img_size, self.img_size, 3), 114, dtype=np.uint8)
        canvas[:nh, :nw] = np.asarray(img)
        lb = self.labels[i].copy()
        boxes = np.zeros((len(lb), 4), dtype=np.float32)
        if len(lb):
            boxes[:, 0] = (lb[:, 1] - lb[:, 3] / 2) * nw
            boxes[:, 1] = (lb[:, 2] - lb[:, 4] / 2) * nh
            boxes[:, 2] = (lb[:, 1] + lb[:, 3] / 2) * nw
            boxes[:, 3] = (lb[:, 2] + lb[:, 4] / 2) * nh
        if self.augment and random.random() < 0.5:
            canvas = canvas[:, ::-1]
            boxes[:, [0, 2]] = self.img_size - boxes[:, [2, 0]]
        img_t = torch.from_numpy(np.ascontiguousarray(canvas)).permute(2, 0, 1)
        return img_t, torch.from_numpy(lb[:, 0]).long(), torch.from_numpy(boxes)

    @staticmethod
    def collate_fn(batch):
        imgs, cls, boxes = zip(*batch)
        targets = [torch.cat([torch.full((len(c), 1), i), c[:, None].float(), b], 1)
                   for i, (c, b) in enumerate(zip(cls, boxes))]
        return torch.stack(imgs), torch.cat(targets, 0)


# ------------------------------------------------------------------ model
class Conv(nn.Module):
    def __init__(self, c1, c2, k=1, s=1):
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, k // 2, bias=False)
        self.bn = nn.BatchNorm2d(c2, eps=1e-3, momentum=0.03)
        self.act = nn.SiLU(inplace=True)

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class C3(nn.Module):
    def __init__(self, c1, c2, n=1):
        super().__init__()
        c_ = c2 // 2
        self.cv1, self.cv2, self.cv3 = Conv(c1, c_), Conv(c1, c_), Conv(2 * c_, c2)
        self.m = nn.Sequential(*(nn.Sequential(Conv(c_, c_), Conv(c_, c_, 3)) for _ in range(n)))

    def forward(self, x):
        y = self.cv1(x)
        for blk in self.m:
            y = y + blk(y)
        return self.cv3(torch.cat([y, self.cv2(x)], 1))


class YoloNet(nn.Module):
    strides = (8, 16, 32)

    def __init__(self, nc, w=32):
        super().__init__()
        self.nc = nc
        self.stem = nn.Sequential(Conv(3, w, 6, 2), Conv(w, 2 * w, 3, 2), C3(2 * w, 2 * w, 1))
        self.d3 = nn.Sequential(Conv(2 * w, 4 * w, 3, 2), C3(4 * w, 4 * w, 2))
        self.d4 = nn.Sequential(Conv(4 * w, 8 * w, 3, 2), C3(8 * w, 8 * w, 3))
        self.d5 = nn.Sequential(Conv(8 * w, 16 * w, 3, 2), C3(16 * w, 16 * w, 1))
        self.lat = nn.ModuleList([Conv(c, 4 * w) for c in (4 * w, 8 * w, 16 * w)])
        self.smooth = nn.ModuleList([C3(4 * w, 4 * w, 1) for _ in range(3)])
        self.head = nn.ModuleList([nn.Conv2d(4 * w, nc + 5, 1) for _ in range(3)])
        for h in self.head:
            nn.init.constant_(h.bias[4:], -4.6)  # obj/cls prior 0.01

    def forward(self, x):
        p3 = self.d3(self.stem(x))
        p4 = self.d4(p3)
        p5 = self.d5(p4)
        l5 = self.lat[2](p5)
        l4 = self.lat[1](p4) + F.interpolate(l5, scale_factor=2.0)
        l3 = self.lat[0](p3) + F.interpolate(l4, scale_factor=2.0)
        return [h(s(l)) for h, s, l in zip(self.head, self.smooth, (l3, l4, l5))]


def make_grid(feat, stride):
    h, w = feat.shape[-2:]
    ys, xs = torch.meshgrid(torch.arange(h, device=feat.device), torch.arange(w, device=feat.device), indexing="ij")
    return (torch.stack([xs, ys], -1).float() + 0.5) * stride


def decode(preds, strides):
    out = []
    for p, s in zip(preds, strides):
        b, c, h, w = p.shape
        p = p.permute(0, 2, 3, 1).reshape(b, h * w, c)
        ctr = make_grid(p.new_empty(1, 1, h, w), s).view(1, -1, 2)
        ltrb = p[..., :4].float().clamp(max=10).exp() * s
        boxes = torch.cat([ctr - ltrb[..., :2], ctr + ltrb[..., 2:]], -1)
        out.append(torch.cat([boxes, p[..., 4:].float()], -1))
    return torch.cat(out, 1)


def compute_loss(preds, targets, nc, strides):
    dec = decode(preds, strides)
    obj_t = torch.zeros(dec.shape[:2], device=dec.device)
    cls_loss, box_loss, npos = dec.new_zeros(()), dec.new_zeros(()), 0
    offsets, lvl_ranges = [0], [(0, 64), (64, 128), (128, 1e8)]
    for p in preds:
        offsets.append(offsets[-1] + p.shape[2] * p.shape[3])
    for lvl, (p, s) in enumerate(zip(preds, strides)):
        w = p.shape[3]
        t = targets[(targets[:, 4:].sub(targets[:, 2:4]).max(1).values >= lvl_ranges[lvl][0])
                    & (targets[:, 4:].sub(targets[:, 2:4]).max(1).values < lvl_ranges[lvl][1])]
        if len(t) == 0:
            continue
        cx = ((t[:, 2] + t[:, 4]) / 2 / s).long().clamp(0, w - 1)
        cy = ((t[:, 3] + t[:, 5]) / 2 / s).long().clamp(0, p.shape[2] - 1)
        idx = offsets[lvl] + cy * w + cx
        bi = t[:, 0].long()
        obj_t[bi, idx] = 1.0
        pd = dec[bi, idx]
        box_loss = box_loss + generalized_box_iou_loss(pd[:, :4], t[:, 2:6], reduction="sum")
        cls_t = F.one_hot(t[:, 1].long(), nc).float()
        cls_loss = cls_loss + F.binary_cross_entropy_with_logits(pd[:, 5:], cls_t, reduction="sum")
        npos += len(t)
    obj_loss = F.binary_cross_entropy_with_logits(dec[..., 4], obj_t, reduction="sum")
    npos = max(npos, 1)
    return (5.0 * box_loss + cls_loss + obj_loss) / npos, torch.stack([box_loss, obj_loss, cls_loss]) / npos


class ModelEMA:
    def __init__(self, model, decay=0.9999, tau=2000, updates=0):
        self.ema = deepcopy(model).eval()
        self.updates = updates
        self.decay = lambda x: decay * (1 - math.exp(-x / tau))
        for p in self.ema.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        self.updates += 1
        d = self.decay(self.updates)
        msd = model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(d).add_(msd[k].detach(), alpha=1 - d)


def de_parallel(model):
    return model.module if isinstance(model, DDP) else model


@torch.no_grad()
def validate(model, loader, device, nc):
    metric = MeanAveragePrecision(iou_type="bbox")
    model.eval()
    for imgs, targets in loader:
        imgs = imgs.to(device).float() / 255
        out = decode(model(imgs), YoloNet.strides)
        scores_all = out[..., 4:5].sigmoid() * out[..., 5:].sigmoid()
        preds, gts = [], []
        for b in range(len(imgs)):
            sc, lb = scores_all[b].max(1)
            keep = sc > 0.001
            boxes, sc, lb = out[b, keep, :4], sc[keep], lb[keep]
            k = batched_nms(boxes, sc, lb, 0.65)[:300]
            preds.append({"boxes": boxes[k].cpu(), "scores": sc[k].cpu(), "labels": lb[k].cpu()})
            t = targets[targets[:, 0] == b]
            gts.append({"boxes": t[:, 2:6], "labels": t[:, 1].long()})
        metric.update(preds, gts)
    res = metric.compute()
    return res["map_50"].item(), res["map"].item()


def parse_opt():
    p = argparse.ArgumentParser()
    p.add_argument("--data", type=str, default="data/visdrone.yaml")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64, help="total batch size for all GPUs")
    p.add_argument("--img-size", type=int, default=640)
    p.add_argument("--lr0", type=float, default=0.01)
    p.add_argument("--warmup-epochs", type=float, default=3.0)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--project", type=str, default="runs/train")
    p.add_argument("--resume", type=str, default="")
    return p.parse_args()


def main(opt):
    torch.cuda.set_device(LOCAL_RANK)
    device = torch.device("cuda", LOCAL_RANK)
    dist.init_process_group("nccl", timeout=timedelta(hours=3))
    data = yaml.safe_load(open(opt.data))
    nc = int(data["nc"])
    save_dir = Path(opt.project)
    if RANK == 0:
        save_dir.mkdir(parents=True, exist_ok=True)

    batch_size = opt.batch_size // WORLD_SIZE
    with torch_distributed_zero_first(LOCAL_RANK):
        train_set = YoloDataset(data["train"], opt.img_size, augment=True)
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler, num_workers=opt.workers,
                              pin_memory=True, collate_fn=YoloDataset.collate_fn)
    val_loader = None
    if RANK == 0:
        val_set = YoloDataset(data["val"], opt.img_size)
        val_loader = DataLoader(val_set, batch_size=batch_size * 2, num_workers=opt.workers,
                                collate_fn=YoloDataset.collate_fn)

    model = YoloNet(nc).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    nbs = 64
    accumulate = max(round(nbs / opt.batch_size), 1)
    g_bn = [p for n, p in model.named_parameters() if ".bn." in n or n.endswith(".bias")]
    g_w = [p for n, p in model.named_parameters() if not (".bn." in n or n.endswith(".bias"))]
    optimizer = torch.optim.SGD(g_bn, lr=opt.lr0, momentum=0.937, nesterov=True)
    optimizer.add_param_group({"params": g_w, "weight_decay": 5e-4 * opt.batch_size * accumulate / nbs})
    lf = lambda x: (1 - x / opt.epochs) * (1.0 - 0.01) + 0.01
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lf)
    ema = ModelEMA(model) if RANK == 0 else None

    start_epoch, best = 0, 0.0
    if opt.resume:
        ckpt = torch.load(opt.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"] + 1
        best = ckpt.get("best", 0.0)
        if ema is not None:
            ema.ema.load_state_dict(ckpt["ema"])
            ema.updates = ckpt["updates"]
        scheduler.last_epoch = start_epoch - 1

    model = DDP(model, device_ids=[LOCAL_RANK], output_device=LOCAL_RANK)
    scaler = torch.cuda.amp.GradScaler()
    nb = len(train_loader)
    nw = max(round(opt.warmup_epochs * nb), 100)
    gs = torch.tensor([opt.img_size], device=device)

    for epoch in range(start_epoch, opt.epochs):
        model.train()
        sampler.set_epoch(epoch)
        optimizer.zero_grad()
        mloss = torch.zeros(3, device=device)
        t0 = time.time()
        for i, (imgs, targets) in enumerate(train_loader):
            ni = i + nb * epoch
            imgs = imgs.to(device, non_blocking=True).float() / 255
            targets = targets.to(device)
            if ni <= nw:
                accumulate = max(1, round(np.interp(ni, [0, nw], [1, nbs / opt.batch_size])))
                for j, x in enumerate(optimizer.param_groups):
                    x["lr"] = np.interp(ni, [0, nw], [0.1 if j == 0 else 0.0, x["initial_lr"] * lf(epoch)])

            # multi-scale: rank 0 draws the size so every rank trains on the same shape
            if i % 10 == 0:
                if RANK == 0:
                    gs[0] = random.randrange(int(opt.img_size * 0.5), int(opt.img_size * 1.5) + 32) // 32 * 32
                dist.broadcast(gs, src=0)
            sz = int(gs.item())
            if sz != imgs.shape[-1]:
                sf = sz / imgs.shape[-1]
                imgs = F.interpolate(imgs, size=(sz, sz), mode="bilinear", align_corners=False)
                targets[:, 2:] *= sf

            with torch.cuda.amp.autocast():
                preds = model(imgs)
                loss, loss_items = compute_loss(preds, targets, nc, YoloNet.strides)
            scaler.scale(loss * WORLD_SIZE).backward()

            if (ni + 1) % accumulate == 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                if ema is not None:
                    ema.update(de_parallel(model))

            mloss = (mloss * i + loss_items.detach()) / (i + 1)
            if RANK == 0 and i % 50 == 0:
                print(f"{epoch}/{opt.epochs - 1} {i}/{nb} size {sz} box {mloss[0]:.4f} obj {mloss[1]:.4f} "
                      f"cls {mloss[2]:.4f} {time.time() - t0:.0f}s", flush=True)
        scheduler.step()

        if RANK == 0:
            map50, map_ = validate(ema.ema, val_loader, device, nc)
            print(f"epoch {epoch}: mAP@0.5 {map50:.4f} mAP@0.5:0.95 {map_:.4f}")
            best = max(best, map_)
            ckpt = {"epoch": epoch, "best": best, "model": de_parallel(model).state_dict(),
                    "ema": ema.ema.state_dict(), "updates": ema.updates, "optimizer": optimizer.state_dict()}
            torch.save(ckpt, save_dir / "last.pt")
            if best == map_:
                torch.save(ckpt, save_dir / "best.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_opt())
