"""SSDlite320 / MobileNetV3-Large on COCO.

Images are pre-resized to 320x320 once and kept in a uint8 memmap next to the
annotations, which makes the 600-epoch schedule I/O-cheap.

    torchrun --nproc_per_node=8 ssdlite_mobilenet.py --coco /data/coco --cache-dir /data/coco/cache
"""
import argparse
import math
import os
import time
from multiprocessing.pool import ThreadPool

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.models.detection import ssdlite320_mobilenet_v3_large

SIZE = 320


class CachedCoco(Dataset):
    def __init__(self, root, split, cache_dir, train):
        self.coco = COCO(os.path.join(root, "annotations", f"instances_{split}2017.json"))
        self.img_dir = os.path.join(root, f"{split}2017")
        self.train = train
        ids = sorted(self.coco.imgs.keys())
        if train:
            ids = [i for i in ids if len(self.coco.getAnnIds(imgIds=i, iscrowd=False)) > 0]
        self.ids = ids
        self.sizes = np.array([[self.coco.imgs[i]["width"], self.coco.imgs[i]["height"]] for i in ids], dtype=np.float32)
        os.makedirs(cache_dir, exist_ok=True)
        self.imgs = self._cache_images(os.path.join(cache_dir, f"{split}2017_{SIZE}.uint8"))

    def _load_resized(self, i):
        info = self.coco.imgs[self.ids[i]]
        img = Image.open(os.path.join(self.img_dir, info["file_name"])).convert("RGB")
        return np.asarray(img.resize((SIZE, SIZE), Image.BILINEAR))

    def _cache_images(self, cache_file):
        shape = (len(self.ids), SIZE, SIZE, 3)
        if not os.path.exists(cache_file):
            print(f"caching {len(self.ids)} images -> {cache_file} ({np.prod(shape) / 1e9:.1f} GB)", flush=True)
            arr = np.memmap(cache_file, shape=shape, dtype=np.uint8, mode="w+")
            with ThreadPool(min(16, os.cpu_count())) as pool:
                for i, im in enumerate(pool.imap(self._load_resized, range(len(self.ids)), chunksize=64)):
                    arr[i] = im
            arr.flush()
            del arr
        return np.memmap(cache_file, shape=shape, dtype=np.uint8, mode="r")

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, idx):
        img_id = self.ids[idx]
        w, h = self.sizes[idx]
        anns = self.coco.loadAnns(self.coco.getAnnIds(imgIds=img_id, iscrowd=False))
        boxes = np.array([a["bbox"] for a in anns], dtype=np.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        boxes *= np.array([SIZE / w, SIZE / h, SIZE / w, SIZE / h], dtype=np.float32)
        boxes = boxes.clip(0, SIZE)
        labels = np.array([a["category_id"] for a in anns], dtype=np.int64)
        keep = (boxes[:, 2] - boxes[:, 0] > 1) & (boxes[:, 3] - boxes[:, 1] > 1)
        boxes, labels = boxes[keep], labels[keep]
        img = torch.from_numpy(np.array(self.imgs[idx])).permute(2, 0, 1).float().div_(255)
        if self.train and np.random.rand() < 0.5:
            img = img.flip(-1)
            boxes = np.stack([SIZE - boxes[:, 2], boxes[:, 1], SIZE - boxes[:, 0], boxes[:, 3]], 1)
        target = {"boxes": torch.from_numpy(boxes), "labels": torch.from_numpy(labels), "image_id": img_id,
                  "scale": torch.tensor([w / SIZE, h / SIZE, w / SIZE, h / SIZE])}
        return img, target


def collate(batch):
    return tuple(zip(*batch))


def cosine_with_warmup(epochs, iters_per_epoch, warmup_epochs=5):
    total = epochs * iters_per_epoch
    warm = warmup_epochs * iters_per_epoch

    def f(it):
        if it < warm:
            return 0.001 + (1 - 0.001) * it / warm
        return 0.5 * (1 + math.cos(math.pi * (it - warm) / (total - warm)))
    return f


@torch.no_grad()
def coco_evaluate(model, loader, coco_gt, device):
    model.eval()
    local = {}
    for imgs, targets in loader:
        outs = model([im.to(device) for im in imgs])
        for t, o in zip(targets, outs):
            b = o["boxes"].cpu() * t["scale"]
            b[:, 2:] -= b[:, :2]
            local[t["image_id"]] = [{"image_id": t["image_id"], "category_id": int(c), "bbox": bb, "score": float(s)}
                                    for bb, s, c in zip(b.tolist(), o["scores"].tolist(), o["labels"].tolist())]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    if dist.get_rank() != 0:
        return None
    merged = {k: v for p in parts for k, v in p.items()}
    dets = [d for v in merged.values() for d in v]
    if not dets:
        return 0.0
    ev = COCOeval(coco_gt, coco_gt.loadRes(dets), "bbox")
    ev.params.imgIds = sorted(merged)
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return ev.stats[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--coco", default="/data/coco")
    ap.add_argument("--cache-dir", default="/data/coco/cache")
    ap.add_argument("--out", default="checkpoints/ssdlite")
    ap.add_argument("--epochs", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--lr", type=float, default=0.15)
    ap.add_argument("--wd", type=float, default=4e-5)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    train_ds = CachedCoco(args.coco, "train", args.cache_dir, train=True)
    val_ds = CachedCoco(args.coco, "val", args.cache_dir, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          collate_fn=collate, pin_memory=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, 32, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=args.workers, collate_fn=collate)

    model = ssdlite320_mobilenet_v3_large(weights=None, weights_backbone="IMAGENET1K_V1", num_classes=91)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    core = model.module

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=args.wd)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(args.epochs, len(train_dl)))

    start = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        core.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, agg = time.time(), torch.zeros(2, device=device)
        for step, (imgs, targets) in enumerate(train_dl):
            imgs = [im.to(device, non_blocking=True) for im in imgs]
            targets = [{"boxes": t["boxes"].to(device), "labels": t["labels"].to(device)} for t in targets]
            losses = model(imgs, targets)
            loss = losses["bbox_regression"] + losses["classification"]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            agg += torch.stack([losses["bbox_regression"].detach(), losses["classification"].detach()])
        dist.all_reduce(agg)
        agg /= dist.get_world_size() * len(train_dl)
        if rank == 0:
            print(f"epoch {epoch}: reg {agg[0]:.4f} cls {agg[1]:.4f} lr {sched.get_last_lr()[0]:.4f} "
                  f"{time.time() - t0:.0f}s", flush=True)
            torch.save({"model": core.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, "last.pth"))
        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            ap50_95 = coco_evaluate(core, val_dl, val_ds.coco, device)
            if rank == 0:
                print(f"epoch {epoch}: bbox mAP {ap50_95:.4f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
