"""Global Wheat Detection - Faster R-CNN R50-FPN v2, multi-GPU.

Holds out a fraction of the training images for validation (the competition has no public val split).

    torchrun --nproc_per_node=4 wheat_frcnn.py --data-dir /kaggle/input/global-wheat-detection
"""
import argparse
import ast
import os
import random
import time

import albumentations as A
import cv2
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torchmetrics.detection import MeanAveragePrecision
from torchvision.models.detection import fasterrcnn_resnet50_fpn_v2
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="/kaggle/input/global-wheat-detection")
    p.add_argument("--img-size", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--val-frac", type=float, default=0.15)
    p.add_argument("--seed", type=int, default=2020)
    p.add_argument("--output", default="models/wheat_frcnn")
    return p.parse_args()


class WheatDataset(Dataset):
    def __init__(self, df, image_ids, img_dir, transforms):
        self.groups = {k: g for k, g in df[df.image_id.isin(set(image_ids))].groupby("image_id")}
        self.image_ids = list(image_ids)
        self.img_dir = img_dir
        self.transforms = transforms

    def __len__(self):
        return len(self.image_ids)

    def __getitem__(self, idx):
        image_id = self.image_ids[idx]
        img = cv2.cvtColor(cv2.imread(os.path.join(self.img_dir, f"{image_id}.jpg")), cv2.COLOR_BGR2RGB)
        g = self.groups[image_id]
        boxes = np.stack(g.bbox.apply(ast.literal_eval).values).astype(np.float32)
        boxes[:, 2:] += boxes[:, :2]
        boxes = boxes.clip(0, img.shape[1])
        boxes = boxes[(boxes[:, 2] - boxes[:, 0] > 1) & (boxes[:, 3] - boxes[:, 1] > 1)]
        out = self.transforms(image=img, bboxes=boxes, labels=np.ones(len(boxes), dtype=np.int64))
        img = torch.from_numpy(out["image"]).permute(2, 0, 1).float() / 255.0
        b = torch.tensor(np.array(out["bboxes"]), dtype=torch.float32).reshape(-1, 4)
        return img, {"boxes": b, "labels": torch.ones(len(b), dtype=torch.int64)}, image_id


def train_aug(size):
    return A.Compose([
        A.RandomSizedBBoxSafeCrop(size, size, erosion_rate=0.0, p=0.5),
        A.HueSaturationValue(hue_shift_limit=0.2, sat_shift_limit=0.2, val_shift_limit=0.2, p=0.9),
        A.RandomBrightnessContrast(0.2, 0.2, p=0.9),
        A.HorizontalFlip(p=0.5),
        A.VerticalFlip(p=0.5),
        A.RandomRotate90(p=0.5),
        A.Resize(size, size),
    ], bbox_params=A.BboxParams(format="pascal_voc", label_fields=["labels"], min_visibility=0.3))


def val_aug(size):
    return A.Compose([A.Resize(size, size)], bbox_params=A.BboxParams(format="pascal_voc", label_fields=["labels"]))


def collate(batch):
    return tuple(zip(*batch))


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    metric = MeanAveragePrecision(iou_thresholds=[0.5, 0.55, 0.6, 0.65, 0.7, 0.75]).to(device)
    for imgs, tgts, _ in loader:
        preds = model([im.to(device) for im in imgs])
        metric.update(preds, [{k: v.to(device) for k, v in t.items()} for t in tgts])
    return metric.compute()["map"].item()  # states are synced across ranks inside compute()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # each rank gets its own augmentation stream
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    df = pd.read_csv(os.path.join(args.data_dir, "train.csv"))
    image_ids = sorted(df.image_id.unique())
    random.shuffle(image_ids)
    n_val = int(len(image_ids) * args.val_frac)
    val_ids, train_ids = image_ids[:n_val], image_ids[n_val:]

    img_dir = os.path.join(args.data_dir, "train")
    train_ds = WheatDataset(df, train_ids, img_dir, train_aug(args.img_size))
    val_ds = WheatDataset(df, val_ids, img_dir, val_aug(args.img_size))
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=4,
                          collate_fn=collate, pin_memory=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=8, num_workers=4,
                        collate_fn=collate)

    model = fasterrcnn_resnet50_fpn_v2(weights="COCO_V1", min_size=args.img_size, max_size=args.img_size)
    model.roi_heads.box_predictor = FastRCNNPredictor(model.roi_heads.box_predictor.cls_score.in_features, 2)
    model.roi_heads.detections_per_img = 150
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr * world * args.batch_size / 16, momentum=0.9, weight_decay=1e-4)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=len(train_dl))
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=(args.epochs - 1) * len(train_dl))
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[len(train_dl)])

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        print(f"{len(train_ids)} train / {len(val_ids)} val images on {world} GPUs")

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        total = torch.zeros(1, device=device)
        for imgs, tgts, _ in train_dl:
            imgs = [im.to(device, non_blocking=True) for im in imgs]
            tgts = [{k: v.to(device) for k, v in t.items()} for t in tgts]
            loss = sum(model(imgs, tgts).values())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            total += loss.detach()
        dist.all_reduce(total)
        mean_loss = total.item() / (world * len(train_dl))

        val_map = validate(model.module, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch:02d} loss {mean_loss:.4f} val mAP@.5:.75 {val_map:.4f} "
                  f"lr {scheduler.get_last_lr()[0]:.5f} {time.time() - t0:.0f}s", flush=True)
            torch.save(model.module.state_dict(), os.path.join(args.output, "last.pth"))
            if val_map > best:
                best = val_map
                torch.save(model.module.state_dict(), os.path.join(args.output, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
