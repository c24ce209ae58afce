"""Train the pedestrian detector used by a ByteTrack-style tracking-by-detection pipeline.

Training data: MOT17 train-half frames + CrowdHuman train/val (full-body boxes), both
converted to COCO json by tools/convert_*.py. Validation: MOT17 val-half, COCO AP.
"""
import argparse
import datetime
import json
import logging
import os
import time

import torch
import torch.distributed as dist
import torchvision
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.detection import fasterrcnn_resnet50_fpn_v2
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
import torchvision.transforms.v2 as T
from torchvision import tv_tensors

logger = logging.getLogger("det")


def build_parser():
    parser = argparse.ArgumentParser(description="ByteTrack detector training")
    parser.add_argument("--mot-root", default="/data/mot/MOT17")
    parser.add_argument("--ch-root", default="/data/mot/crowdhuman")
    parser.add_argument("--output", default="work_dirs/det_frcnn_mot17_ch")
    parser.add_argument("--epochs", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=4, help="images per GPU")
    parser.add_argument("--lr", type=float, default=0.02, help="for a global batch of 32")
    parser.add_argument("--warmup-iters", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--resume", default="")
    return parser


class CocoBoxes(Dataset):
    def __init__(self, img_root, ann_file, train=True):
        self.img_root = img_root
        self.coco = COCO(ann_file)
        self.ids = sorted(self.coco.getImgIds())
        if train:
            self.ids = [i for i in self.ids if len(self.coco.getAnnIds(imgIds=i, iscrowd=False)) > 0]
        aug = [T.RandomHorizontalFlip(0.5), T.RandomPhotometricDistort(p=0.5)] if train else []
        self.tf = T.Compose(aug + [T.ToImage(), T.ToDtype(torch.float32, scale=True), T.SanitizeBoundingBoxes()])

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, idx):
        img_id = self.ids[idx]
        info = self.coco.loadImgs(img_id)[0]
        img = Image.open(os.path.join(self.img_root, info["file_name"])).convert("RGB")
        anns = [a for a in self.coco.loadAnns(self.coco.getAnnIds(imgIds=img_id)) if not a.get("iscrowd", 0)]
        boxes = [[a["bbox"][0], a["bbox"][1], a["bbox"][0] + a["bbox"][2], a["bbox"][1] + a["bbox"][3]] for a in anns]
        boxes = torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4)
        target = {
            "boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(img.height, img.width)),
            "labels": torch.ones(len(anns), dtype=torch.int64),
            "image_id": img_id,
        }
        img, target = self.tf(img, target)
        return img, target


def collate(batch):
    return tuple(zip(*batch))


def setup_logging(rank, out_dir):
    level = logging.INFO if rank == 0 else logging.WARNING
    handlers = [logging.StreamHandler()]
    if rank == 0:
        handlers.append(logging.FileHandler(os.path.join(out_dir, "train.log")))
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(message)s", handlers=handlers)


def warmup_factor(it, warmup_iters):
    if it >= warmup_iters:
        return 1.0
    alpha = it / warmup_iters
    return 0.001 * (1 - alpha) + alpha


@torch.no_grad()
def evaluate(model, dataset, rank, world, device, batch_size=8):
    model.eval()
    idx = list(range(rank, len(dataset), world))
    subset = torch.utils.data.Subset(dataset, idx)
    loader = DataLoader(subset, batch_size=batch_size, num_workers=4, collate_fn=collate)
    dets = []
    for imgs, targets in loader:
        outputs = model([im.to(device) for im in imgs])
        for out, tgt in zip(outputs, targets):
            for box, score in zip(out["boxes"].tolist(), out["scores"].tolist()):
                x1, y1, x2, y2 = box
                dets.append({"image_id": tgt["image_id"], "category_id": 1,
                             "bbox": [x1, y1, x2 - x1, y2 - y1], "score": score})
    all_dets = [None] * world
    dist.all_gather_object(all_dets, dets)
    ap = 0.0
    if rank == 0:
        dets = [d for part in all_dets for d in part]
        if dets:
            coco_dt = dataset.coco.loadRes(dets)
            ev = COCOeval(dataset.coco, coco_dt, "bbox")
            ev.evaluate()
            ev.accumulate()
            ev.summarize()
            ap = ev.stats[0]
    model.train()
    return ap


def main():
    args = build_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
    dist.barrier()
    setup_logging(rank, args.output)
    logger.info("args: %s", vars(args))

    mot_train = CocoBoxes(os.path.join(args.mot_root, "train"), os.path.join(args.mot_root, "annotations", "train_half.json"))
    ch_train = CocoBoxes(os.path.join(args.ch_root, "CrowdHuman_train"), os.path.join(args.ch_root, "annotations", "train.json"))
    ch_val = CocoBoxes(os.path.join(args.ch_root, "CrowdHuman_val"), os.path.join(args.ch_root, "annotations", "val.json"))
    train_set = ConcatDataset([mot_train, ch_train, ch_val])
    val_set = CocoBoxes(os.path.join(args.mot_root, "train"), os.path.join(args.mot_root, "annotations", "val_half.json"), train=False)

    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        collate_fn=collate, pin_memory=True, drop_last=True)

    model = fasterrcnn_resnet50_fpn_v2(weights="DEFAULT", min_size=800, max_size=1440, box_detections_per_img=300)
    model.roi_heads.box_predictor = FastRCNNPredictor(model.roi_heads.box_predictor.cls_score.in_features, 2)
    model.to(device)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-4)
    iters_per_epoch = len(loader)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[16 * iters_per_epoch, 22 * iters_per_epoch], gamma=0.1)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    start_epoch, best_ap = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_ap = ckpt["epoch"] + 1, ckpt.get("best_ap", 0.0)

    global_it = start_epoch * iters_per_epoch
    for epoch in range(start_epoch, args.epochs):
        model.train()
        tic = time.time()
        for i, (imgs, targets) in enumerate(loader):
            imgs = [im.to(device, non_blocking=True) for im in imgs]
            targets = [{"boxes": t["boxes"].to(device), "labels": t["labels"].to(device)} for t in targets]
            if global_it < args.warmup_iters:
                f = warmup_factor(global_it, args.warmup_iters)
                for g in optimizer.param_groups:
                    g["lr"] = args.lr * f
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                loss_dict = model(imgs, targets)
                loss = sum(loss_dict.values())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            global_it += 1
            if i % 100 == 0:
                vals = torch.stack([v.detach() for v in loss_dict.values()])
                dist.all_reduce(vals)
                vals = (vals / world).tolist()
                msg = " ".join(f"{k}: {v:.4f}" for k, v in zip(loss_dict.keys(), vals))
                logger.info(f"epoch {epoch} [{i}/{iters_per_epoch}] {msg} lr {optimizer.param_groups[0]['lr']:.5f} "
                            f"mem {torch.cuda.max_memory_allocated() / 2**30:.1f}G")
        logger.info(f"epoch {epoch} done in {time.time() - tic:.0f}s")

        ap = evaluate(model.module, val_set, rank, world, device)
        if rank == 0:
            logger.info(f"epoch {epoch} MOT17 val-half AP {ap:.4f}")
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch, "best_ap": max(best_ap, ap)}
            torch.save(state, os.path.join(args.output, "last.pth"))
            if ap > best_ap:
                best_ap = ap
                torch.save(state, os.path.join(args.output, "best.pth"))
                with open(os.path.join(args.output, "best.json"), "w") as f:
                    json.dump({"epoch": epoch, "ap": ap}, f)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
