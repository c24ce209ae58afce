"""Sorghum panicle detection on UAV orthomosaic tiles (Faster R-CNN, torchvision).

Annotations are panicle boxes drawn in QGIS on the full orthomosaic (one
GeoPackage per flight). On first use they are converted to per-tile pixel
boxes and cached in <data>/cache/tiles_<tile>_<overlap>.pt; the cache is
built once by rank 0 and read by everyone afterwards.

    torchrun --nproc_per_node=4 10_sorghum_panicle_frcnn.py --data /data/sorghum22 --epochs 36
"""
import argparse
import math
import os
import time
from datetime import timedelta

import geopandas as gpd
import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torchvision
import wandb
from rasterio.windows import Window
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchmetrics.detection import MeanAveragePrecision
from torchvision.models.detection import fasterrcnn_resnet50_fpn_v2
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--tile", type=int, default=1024)
    p.add_argument("--overlap", type=int, default=128)
    p.add_argument("--epochs", type=int, default=36)
    p.add_argument("--batch-size", type=int, default=4, help="images per GPU")
    p.add_argument("--base-lr", type=float, default=0.02, help="for a global batch of 16")
    p.add_argument("--warmup-iters", type=int, default=500)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--out", default="output/panicle_frcnn")
    p.add_argument("--resume", default="")
    p.add_argument("--no-wandb", action="store_true")
    return p.parse_args()


def build_tile_index(data_root, tile, overlap):
    """Cut every flight's orthomosaic into tiles and convert the GeoPackage boxes to pixel boxes."""
    index = {"train": [], "val": []}
    for split in ("train", "val"):
        for ortho in sorted(os.listdir(os.path.join(data_root, split))):
            if not ortho.endswith(".tif"):
                continue
            path = os.path.join(data_root, split, ortho)
            boxes_gdf = gpd.read_file(path.replace(".tif", "_panicles.gpkg"))
            with rasterio.open(path) as src:
                boxes_gdf = boxes_gdf.to_crs(src.crs)
                inv = ~src.transform
                px = []
                for geom in boxes_gdf.geometry:
                    minx, miny, maxx, maxy = geom.bounds
                    c0, r0 = inv * (minx, maxy)
                    c1, r1 = inv * (maxx, miny)
                    px.append([c0, r0, c1, r1])
                px = np.asarray(px, dtype=np.float32).reshape(-1, 4)
                step = tile - overlap
                for top in range(0, src.height - tile + 1, step):
                    for left in range(0, src.width - tile + 1, step):
                        cx = (px[:, 0] + px[:, 2]) / 2
                        cy = (px[:, 1] + px[:, 3]) / 2
                        m = (cx >= left) & (cx < left + tile) & (cy >= top) & (cy < top + tile)
                        b = px[m] - np.array([left, top, left, top], dtype=np.float32)
                        b = b.clip(0, tile - 1)
                        b = b[((b[:, 2] - b[:, 0]) > 2) & ((b[:, 3] - b[:, 1]) > 2)]
                        index[split].append({"ortho": path, "top": top, "left": left, "boxes": torch.from_numpy(b)})
    return index


class TileDataset(Dataset):
    def __init__(self, items, tile, train):
        self.items = items
        self.tile = tile
        self.train = train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        with rasterio.open(it["ortho"]) as src:
            img = src.read([1, 2, 3], window=Window(it["left"], it["top"], self.tile, self.tile))
        img = torch.from_numpy(img.astype(np.float32) / 255.0)
        boxes = it["boxes"].clone()
        if self.train:
            if torch.rand(1) < 0.5:
                img = img.flip(2)
                boxes[:, [0, 2]] = self.tile - boxes[:, [2, 0]]
            if torch.rand(1) < 0.5:
                img = img.flip(1)
                boxes[:, [1, 3]] = self.tile - boxes[:, [3, 1]]
            img = (img * (0.8 + 0.4 * torch.rand(1)) + 0.1 * (torch.rand(1) - 0.5)).clamp(0, 1)
        target = {"boxes": boxes, "labels": torch.ones(len(boxes), dtype=torch.int64)}
        return img, target


def collate(batch):
    return tuple(zip(*batch))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # the first run builds the tile cache on rank 0 while the others wait at the barrier
    dist.init_process_group("nccl", timeout=timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42 + rank)

    cache = os.path.join(args.data, "cache", f"tiles_{args.tile}_{args.overlap}.pt")
    if rank == 0 and not os.path.exists(cache):
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        index = build_tile_index(args.data, args.tile, args.overlap)
        torch.save(index, cache + ".tmp")
        os.replace(cache + ".tmp", cache)
    dist.barrier()
    index = torch.load(cache)

    train_ds = TileDataset(index["train"], args.tile, train=True)
    val_ds = TileDataset(index["val"], args.tile, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              collate_fn=collate, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=4,
                            num_workers=args.workers, collate_fn=collate)

    model = fasterrcnn_resnet50_fpn_v2(weights="DEFAULT", min_size=args.tile, max_size=args.tile,
                                       box_detections_per_img=300)
    model.roi_heads.box_predictor = FastRCNNPredictor(model.roi_heads.box_predictor.cls_score.in_features, 2)
    model.to(device)
    # backbone norm layers are FrozenBatchNorm2d in torchvision detection models
    model = DDP(model, device_ids=[local_rank])

    # linear scaling from the reference global batch of 16
    lr = args.base_lr * args.batch_size * world / 16
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
    iters_per_epoch = len(train_loader)
    milestones = [int(args.epochs * 0.67) * iters_per_epoch, int(args.epochs * 0.89) * iters_per_epoch]

    def lr_lambda(it):
        warm = min(1.0, (it + 1) / args.warmup_iters) * (1 - 1e-3) + 1e-3
        return warm * (0.1 ** sum(it >= m for m in milestones))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1

    use_wandb = rank == 0 and not args.no_wandb
    if use_wandb:
        wandb.init(project="sorghum-panicles", config={**vars(args), "world_size": world, "lr": lr},
                   resume="allow", id=os.environ.get("WANDB_RUN_ID"))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    metric = MeanAveragePrecision(iou_type="bbox", box_format="xyxy").to(device)
    for epoch in range(start_epoch, args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (imgs, targets) in enumerate(train_loader):
            imgs = [im.to(device, non_blocking=True) for im in imgs]
            targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
            losses = model(imgs, targets)
            loss = sum(losses.values())
            if not math.isfinite(loss.item()):
                raise RuntimeError(f"rank {rank}: loss is {loss.item()}, stopping")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if it % 20 == 0:
                # average the loss terms over ranks for logging (every rank takes this branch)
                names = list(losses.keys())
                logged = torch.stack([losses[k].detach() for k in names])
                dist.all_reduce(logged, op=dist.ReduceOp.AVG)
                if use_wandb:
                    wandb.log({f"train/{k}": v.item() for k, v in zip(names, logged)}
                              | {"lr": scheduler.get_last_lr()[0]})

        model.eval()
        with torch.no_grad():
            for imgs, targets in val_loader:
                preds = model.module([im.to(device) for im in imgs])
                metric.update(preds, [{k: v.to(device) for k, v in t.items()} for t in targets])
        res = metric.compute()  # gathers the states from all ranks
        metric.reset()

        if rank == 0:
            msg = {"epoch": epoch, "mAP": res["map"].item(), "mAP50": res["map_50"].item(),
                   "epoch_min": (time.time() - t0) / 60}
            print(msg, flush=True)
            if use_wandb:
                wandb.log({f"val/{k}": v for k, v in msg.items()})
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "checkpoint.pth"))
        dist.barrier()

    if use_wandb:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
