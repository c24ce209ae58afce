"""PubLayNet page layout detection (text / title / list / table / figure) with torchvision Faster R-CNN.

Single node, processes started with torch.multiprocessing:
    python 05_publaynet_frcnn_spawn.py --root /data/publaynet --gpus 4
"""
import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.detection import fasterrcnn_resnet50_fpn_v2
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.transforms import functional as TF

NUM_CLASSES = 6  # background + 5 PubLayNet categories


def build_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--port", default="29533")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--bs", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--ckpt", default="work_dirs/publaynet_frcnn/latest.pth")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--val_subset", type=int, default=5000)
    return p


def build_index(ann_file, cache_file):
    """Parse the (very large) COCO json once into a compact list of per-image targets."""
    coco = COCO(ann_file)
    cat_ids = sorted(coco.getCatIds())
    cat_map = {c: i + 1 for i, c in enumerate(cat_ids)}
    records = []
    for img_id in sorted(coco.getImgIds()):
        info = coco.loadImgs(img_id)[0]
        boxes, labels = [], []
        for a in coco.loadAnns(coco.getAnnIds(imgIds=img_id, iscrowd=False)):
            x, y, w, h = a["bbox"]
            if w < 1 or h < 1:
                continue
            boxes.append([x, y, x + w, y + h])
            labels.append(cat_map[a["category_id"]])
        records.append({"id": img_id, "file": info["file_name"], "boxes": boxes, "labels": labels})
    tmp = cache_file + ".tmp"
    torch.save({"records": records, "cat_ids": cat_ids}, tmp)
    os.replace(tmp, cache_file)


def load_index(root, split, rank):
    ann = os.path.join(root, f"{split}.json")
    cache = os.path.join(root, f".{split}_index.pt")
    if rank == 0 and not os.path.exists(cache):
        build_index(ann, cache)
    dist.barrier()
    return torch.load(cache)


class PubLayNet(Dataset):
    def __init__(self, root, split, index, train):
        self.img_dir = os.path.join(root, split)
        self.records = index["records"]
        self.train = train

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        r = self.records[i]
        img = TF.to_tensor(Image.open(os.path.join(self.img_dir, r["file"])).convert("RGB"))
        boxes = torch.tensor(r["boxes"], dtype=torch.float32).reshape(-1, 4)
        labels = torch.tensor(r["labels"], dtype=torch.int64)
        if self.train and torch.rand(1).item() < 0.5:
            # small brightness jitter only: flipping a page breaks reading layout priors
            img = TF.adjust_brightness(img, 0.8 + 0.4 * torch.rand(1).item())
        return img, {"boxes": boxes, "labels": labels, "image_id": r["id"]}


def collate(batch):
    return tuple(zip(*batch))


def build_model():
    model = fasterrcnn_resnet50_fpn_v2(weights="DEFAULT", min_size=800, max_size=1333)
    in_feat = model.roi_heads.box_predictor.cls_score.in_features
    model.roi_heads.box_predictor = FastRCNNPredictor(in_feat, NUM_CLASSES)
    return model


@torch.no_grad()
def evaluate(model, loader, device, cat_ids, ann_file, rank, world):
    model.eval()
    dets, seen = [], []
    for imgs, targets in loader:
        outs = model([im.to(device) for im in imgs])
        for out, t in zip(outs, targets):
            seen.append(t["image_id"])
            b = out["boxes"].cpu()
            b[:, 2:] -= b[:, :2]
            for box, s, l in zip(b.tolist(), out["scores"].tolist(), out["labels"].tolist()):
                dets.append({"image_id": t["image_id"], "category_id": cat_ids[l - 1],
                             "bbox": [round(v, 2) for v in box], "score": round(s, 4)})
    gathered = [None] * world
    dist.all_gather_object(gathered, (seen, dets))
    model.train()
    if rank != 0:
        return None
    img_ids = sorted({i for ids, _ in gathered for i in ids})
    all_dets = [d for _, part in gathered for d in part]
    gt = COCO(ann_file)
    dt = gt.loadRes(all_dets) if all_dets else COCO()
    ev = COCOeval(gt, dt, iouType="bbox")
    ev.params.imgIds = img_ids
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return ev.stats[0]


def worker(rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    torch.cuda.set_device(rank)
    # the first run parses the full train.json on rank 0 while the others wait at a barrier
    dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=datetime.timedelta(hours=2))
    device = torch.device("cuda", rank)

    train_idx = load_index(args.root, "train", rank)
    val_idx = load_index(args.root, "val", rank)
    train_set = PubLayNet(args.root, "train", train_idx, train=True)
    val_set = PubLayNet(args.root, "val", val_idx, train=False)
    val_ids = list(range(min(len(val_set), args.val_subset)))
    val_shard = Subset(val_set, val_ids[rank::world_size])

    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_dl = DataLoader(train_set, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                          collate_fn=collate, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_shard, batch_size=2, num_workers=args.workers, collate_fn=collate)

    model = build_model().to(device)
    model = DDP(model, device_ids=[rank])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-4)
    iters = len(train_dl) * args.epochs
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [int(iters * 0.67), int(iters * 0.89)], 0.1)

    start_epoch = 0
    if args.resume and os.path.exists(args.ckpt):
        ck = torch.load(args.ckpt, map_location=device)
        state = {k[len("module."):] if k.startswith("module.") else k: v for k, v in ck["model"].items()}
        model.module.load_state_dict(state)
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_epoch = ck["epoch"] + 1
        if rank == 0:
            print(f"resumed from {args.ckpt} at epoch {start_epoch}")

    warmup = 1000
    it = start_epoch * len(train_dl)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for imgs, targets in train_dl:
            imgs = [im.to(device, non_blocking=True) for im in imgs]
            targets = [{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in t.items()} for t in targets]
            if it < warmup:
                for g in optimizer.param_groups:
                    g["lr"] = args.lr * (0.001 + 0.999 * it / warmup)
            losses = model(imgs, targets)
            loss = sum(losses.values())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            it += 1
            if rank == 0 and it % 50 == 0:
                msg = " ".join(f"{k}={v.item():.3f}" for k, v in losses.items())
                print(f"[ep {epoch} it {it}] loss={loss.item():.3f} {msg} lr={optimizer.param_groups[0]['lr']:.4f}",
                      flush=True)

        if rank == 0:
            os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch}, args.ckpt)
            print(f"epoch {epoch} took {(time.time() - t0) / 60:.1f} min, saved {args.ckpt}", flush=True)

        ap = evaluate(model.module, val_dl, device, val_idx["cat_ids"],
                      os.path.join(args.root, "val.json"), rank, world_size)
        if rank == 0:
            print(json.dumps({"epoch": epoch, "bbox_mAP": round(float(ap), 4)}), flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = build_parser().parse_args()
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
