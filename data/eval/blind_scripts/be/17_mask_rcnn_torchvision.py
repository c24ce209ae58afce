"""Fine-tune torchvision Mask R-CNN v2 on a COCO-format instance segmentation dataset
(e.g. LIVECell / a custom export from CVAT).

    torchrun --nproc_per_node=4 17_mask_rcnn_torchvision.py --root /data/livecell \
        --train-ann annotations/train.json --val-ann annotations/val.json --epochs 24
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torchvision
from PIL import Image
from pycocotools import mask as coco_mask
from pycocotools.coco import COCO
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.detection import maskrcnn_resnet50_fpn_v2, MaskRCNN_ResNet50_FPN_V2_Weights
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.models.detection.mask_rcnn import MaskRCNNPredictor
from torchvision.transforms import v2 as T
from torchvision import tv_tensors

from coco_eval import CocoEvaluator  # from torchvision/references/detection
from group_by_aspect_ratio import GroupedBatchSampler, create_aspect_ratio_groups


class CocoInstances(Dataset):
    def __init__(self, root, ann_file, transforms):
        self.root = root
        self.coco = COCO(os.path.join(root, ann_file))
        self.ids = sorted(img_id for img_id in self.coco.imgs if self.coco.getAnnIds(imgIds=img_id, iscrowd=False))
        # contiguous labels 1..K from the sorted category ids: identical on every process
        self.cat_ids = sorted(self.coco.getCatIds())
        self.cat_to_label = {c: i + 1 for i, c in enumerate(self.cat_ids)}
        self.transforms = transforms

    def __len__(self):
        return len(self.ids)

    def get_height_and_width(self, idx):
        info = self.coco.imgs[self.ids[idx]]
        return info["height"], info["width"]

    def __getitem__(self, idx):
        img_id = self.ids[idx]
        info = self.coco.imgs[img_id]
        img = Image.open(os.path.join(self.root, "images", info["file_name"])).convert("RGB")
        anns = [a for a in self.coco.loadAnns(self.coco.getAnnIds(imgIds=img_id)) if not a.get("iscrowd", 0)]
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        masks = np.stack([self.coco.annToMask(a) for a in anns]) if anns else \
            np.zeros((0, info["height"], info["width"]), np.uint8)
        target = {
            "boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(info["height"], info["width"])),
            "masks": tv_tensors.Mask(torch.from_numpy(masks)),
            "labels": torch.tensor([self.cat_to_label[a["category_id"]] for a in anns], dtype=torch.int64),
            "image_id": img_id,
        }
        img, target = self.transforms(tv_tensors.Image(img), target)
        return img, target


def collate(batch):
    return tuple(zip(*batch))


def get_transforms(train):
    t = [T.ToDtype(torch.float32, scale=True)]
    if train:
        t = [T.RandomHorizontalFlip(0.5), T.RandomVerticalFlip(0.5),
             T.RandomPhotometricDistort(p=0.5)] + t + [T.SanitizeBoundingBoxes()]
    return T.Compose(t)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--train-ann", default="annotations/train.json")
    p.add_argument("--val-ann", default="annotations/val.json")
    p.add_argument("--epochs", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=2, help="images per GPU")
    p.add_argument("--base-lr", type=float, default=0.02, help="for a total batch of 16")
    p.add_argument("--warmup-iters", type=int, default=1000)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--out", default="output/mrcnn_v2")
    p.add_argument("--resume", default="")
    # kept for `python -m torch.distributed.launch`, which passes it; LOCAL_RANK from the env wins
    p.add_argument("--local-rank", "--local_rank", type=int, default=0)
    return p.parse_args()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    evaluator = CocoEvaluator(loader.dataset.coco, ["bbox", "segm"])
    for images, targets in loader:
        outputs = model([im.to(device) for im in images])
        outputs = [{k: v.cpu() for k, v in o.items()} for o in outputs]
        # model labels are contiguous, the evaluator wants the dataset's category ids
        for o in outputs:
            o["labels"] = torch.tensor([loader.dataset.cat_ids[l - 1] for l in o["labels"].tolist()],
                                       dtype=torch.int64)
        evaluator.update({t["image_id"]: o for t, o in zip(targets, outputs)})
    evaluator.synchronize_between_processes()
    evaluator.accumulate()
    evaluator.summarize()
    model.train()
    return evaluator.coco_eval["bbox"].stats[0], evaluator.coco_eval["segm"].stats[0]


def main():
    args = get_args()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    total_batch = args.batch_size * world_size
    lr = args.base_lr * total_batch / 16  # linear scaling rule
    warmup_iters = int(args.warmup_iters * 16 / total_batch)

    train_set = CocoInstances(args.root, args.train_ann, get_transforms(train=True))
    val_set = CocoInstances(args.root, args.val_ann, get_transforms(train=False))
    num_classes = len(train_set.cat_ids) + 1

    train_sampler = DistributedSampler(train_set, shuffle=True)
    group_ids = create_aspect_ratio_groups(train_set, k=3)
    train_batch_sampler = GroupedBatchSampler(train_sampler, group_ids, args.batch_size)
    train_loader = DataLoader(train_set, batch_sampler=train_batch_sampler, num_workers=args.workers,
                              collate_fn=collate, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, collate_fn=collate)

    model = maskrcnn_resnet50_fpn_v2(weights=MaskRCNN_ResNet50_FPN_V2_Weights.COCO_V1)
    in_features = model.roi_heads.box_predictor.cls_score.in_features
    model.roi_heads.box_predictor = FastRCNNPredictor(in_features, num_classes)
    model.roi_heads.mask_predictor = MaskRCNNPredictor(256, 256, num_classes)
    model.roi_heads.detections_per_img = 300  # dense cell images
    # v2 has BatchNorm in the FPN and the box/mask heads (the trunk is FrozenBN): sync it at 2 imgs/GPU
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
    lr_scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [int(args.epochs * 0.67), int(args.epochs * 0.89)])
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best_segm = 0, -1.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_segm = ckpt["epoch"] + 1, ckpt["best_segm"]

    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    model_without_ddp = model.module

    it = start_epoch * len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)  # GroupedBatchSampler iterates the sampler it wraps
        model.train()
        t0 = time.time()
        for step, (images, targets) in enumerate(train_loader):
            images = [im.to(device, non_blocking=True) for im in images]
            targets = [{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in t.items()} for t in targets]
            if it < warmup_iters:
                alpha = it / warmup_iters
                for g in optimizer.param_groups:
                    g["lr"] = lr * (0.001 * (1 - alpha) + alpha)
            with torch.autocast("cuda", dtype=torch.float16):
                loss_dict = model(images, targets)
                loss = sum(loss_dict.values())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            it += 1

            if step % 20 == 0:
                reduced = torch.stack([v.detach() for v in loss_dict.values()])
                dist.all_reduce(reduced, op=dist.ReduceOp.AVG)
                if not math.isfinite(reduced.sum().item()):
                    raise RuntimeError(f"non-finite loss at iter {it}: {reduced.tolist()}")
                if rank == 0:
                    print(f"epoch {epoch} [{step}/{len(train_loader)}] loss {reduced.sum().item():.4f} "
                          f"({', '.join(f'{k}={v:.3f}' for k, v in zip(loss_dict, reduced.tolist()))}) "
                          f"lr {optimizer.param_groups[0]['lr']:.5f} {time.time() - t0:.0f}s", flush=True)
        lr_scheduler.step()

        bbox_ap, segm_ap = evaluate(model_without_ddp, val_loader, device)
        is_best = segm_ap > best_segm
        best_segm = max(best_segm, segm_ap)
        if rank == 0:
            print(f"epoch {epoch}: bbox AP {bbox_ap:.4f} segm AP {segm_ap:.4f} best segm {best_segm:.4f}")
            ckpt = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                    "lr_scheduler": lr_scheduler.state_dict(), "scaler": scaler.state_dict(),
                    "epoch": epoch, "best_segm": best_segm, "cat_ids": train_set.cat_ids}
            torch.save(ckpt, os.path.join(args.out, "checkpoint.pth"))
            if is_best:
                torch.save(ckpt, os.path.join(args.out, "model_best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
