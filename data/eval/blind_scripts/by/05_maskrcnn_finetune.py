"""Fine-tune Mask R-CNN (torchvision, COCO-pretrained) on a COCO-format instance segmentation dataset.

Example:
    torchrun --nproc_per_node=4 maskrcnn_finetune.py \
        --train-json data/cells/train.json --train-img data/cells/images \
        --val-json data/cells/val.json --val-img data/cells/images --out runs/cells_mrcnn
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torchvision
from PIL import Image
from pycocotools import mask as mask_util
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.detection import maskrcnn_resnet50_fpn
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.models.detection.mask_rcnn import MaskRCNNPredictor
from torchvision.transforms import functional as TF


class CocoInstances(Dataset):
    def __init__(self, ann_file, img_dir, train=False):
        self.coco = COCO(ann_file)
        self.img_dir = img_dir
        self.train = train
        self.cat_ids = sorted(self.coco.getCatIds())
        self.cat2label = {c: i + 1 for i, c in enumerate(self.cat_ids)}
        self.label2cat = {v: k for k, v in self.cat2label.items()}
        ids = sorted(self.coco.imgs.keys())
        if train:
            ids = [i for i in ids if len(self.coco.getAnnIds(imgIds=i, iscrowd=False)) > 0]
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, idx):
        img_id = self.ids[idx]
        info = self.coco.imgs[img_id]
        img = Image.open(os.path.join(self.img_dir, info["file_name"])).convert("RGB")
        anns = [a for a in self.coco.loadAnns(self.coco.getAnnIds(imgIds=img_id, iscrowd=False))
                if a["bbox"][2] >= 1 and a["bbox"][3] >= 1]
        boxes = torch.tensor([[a["bbox"][0], a["bbox"][1], a["bbox"][0] + a["bbox"][2], a["bbox"][1] + a["bbox"][3]]
                              for a in anns], dtype=torch.float32).reshape(-1, 4)
        labels = torch.tensor([self.cat2label[a["category_id"]] for a in anns], dtype=torch.int64)
        if anns:
            masks = torch.from_numpy(np.stack([self.coco.annToMask(a) for a in anns]))
        else:
            masks = torch.zeros((0, info["height"], info["width"]), dtype=torch.uint8)
        img = TF.to_tensor(img)
        if self.train:
            if torch.rand(()) < 0.5:
                img, masks = img.flip(-1), masks.flip(-1)
                w = img.shape[-1]
                boxes = boxes[:, [2, 1, 0, 3]] * torch.tensor([-1.0, 1, -1, 1]) + torch.tensor([w, 0.0, w, 0])
            if torch.rand(()) < 0.5:
                img, masks = img.flip(-2), masks.flip(-2)
                h = img.shape[-2]
                boxes = boxes[:, [0, 3, 2, 1]] * torch.tensor([1.0, -1, 1, -1]) + torch.tensor([0.0, h, 0, h])
        return img, {"boxes": boxes, "labels": labels, "masks": masks, "image_id": img_id}


def collate_fn(batch):
    return tuple(zip(*batch))


def build_model(num_classes, min_size, max_size):
    model = maskrcnn_resnet50_fpn(weights="COCO_V1", min_size=min_size, max_size=max_size)
    in_features = model.roi_heads.box_predictor.cls_score.in_features
    model.roi_heads.box_predictor = FastRCNNPredictor(in_features, num_classes)
    in_ch = model.roi_heads.mask_predictor.conv5_mask.in_channels
    model.roi_heads.mask_predictor = MaskRCNNPredictor(in_ch, 256, num_classes)
    return model


@torch.no_grad()
def evaluate(model, loader, dataset, device, rank, world):
    model.eval()
    bbox_res, segm_res = [], []
    seen = set()
    for images, targets in loader:
        outputs = model([im.to(device) for im in images])
        for t, o in zip(targets, outputs):
            img_id = t["image_id"]
            if img_id in seen:
                continue
            seen.add(img_id)
            boxes = o["boxes"].cpu().numpy()
            boxes[:, 2:] -= boxes[:, :2]
            masks = (o["masks"][:, 0] > 0.5).cpu().numpy()
            for box, score, label, m in zip(boxes, o["scores"].tolist(), o["labels"].tolist(), masks):
                cat = dataset.label2cat[label]
                bbox_res.append({"image_id": img_id, "category_id": cat, "bbox": box.tolist(), "score": score})
                rle = mask_util.encode(np.asfortranarray(m.astype(np.uint8)))
                rle["counts"] = rle["counts"].decode("ascii")
                segm_res.append({"image_id": img_id, "category_id": cat, "segmentation": rle, "score": score})

    gathered = [None] * world
    dist.all_gather_object(gathered, (sorted(seen), bbox_res, segm_res))
    if rank != 0:
        return {}
    img_ids, bbox_all, segm_all, done = [], [], [], set()
    for ids, b, s in gathered:
        new = set(ids) - done
        img_ids += sorted(new)
        bbox_all += [r for r in b if r["image_id"] in new]
        segm_all += [r for r in s if r["image_id"] in new]
        done |= new
    stats = {}
    for iou_type, res in (("bbox", bbox_all), ("segm", segm_all)):
        if not res:
            stats[iou_type] = 0.0
            continue
        E = COCOeval(dataset.coco, dataset.coco.loadRes(res), iou_type)
        E.params.imgIds = img_ids
        E.evaluate()
        E.accumulate()
        E.summarize()
        stats[iou_type] = float(E.stats[0])
    return stats


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-json", required=True)
    parser.add_argument("--train-img", required=True)
    parser.add_argument("--val-json", required=True)
    parser.add_argument("--val-img", required=True)
    parser.add_argument("--out", default="runs/mrcnn")
    parser.add_argument("--epochs", type=int, default=36)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--warmup-iters", type=int, default=500)
    parser.add_argument("--milestones", type=int, nargs="+", default=[27, 33])
    parser.add_argument("--min-size", type=int, nargs="+", default=[640, 672, 704, 736, 768, 800])
    parser.add_argument("--max-size", type=int, default=1333)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--resume", default="")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    train_set = CocoInstances(args.train_json, args.train_img, train=True)
    val_set = CocoInstances(args.val_json, args.val_img)
    num_classes = len(train_set.cat_ids) + 1
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, collate_fn=collate_fn, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, collate_fn=collate_fn)

    model = build_model(num_classes, tuple(args.min_size), args.max_size)
    start_epoch, best_ap = 0, 0.0
    ckpt = None
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        start_epoch = ckpt["epoch"] + 1
        best_ap = ckpt.get("best_ap", 0.0)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-4)
    iters_per_epoch = len(train_loader)

    def lr_lambda(it):
        epoch = it // iters_per_epoch
        factor = 0.1 ** sum(epoch >= m for m in args.milestones)
        if it < args.warmup_iters:
            factor *= 0.001 + (1 - 0.001) * it / args.warmup_iters
        return factor

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_set)} train / {len(val_set)} val images, {num_classes - 1} classes, {world} GPUs")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        running = torch.zeros(1, device=device)
        for i, (images, targets) in enumerate(train_loader):
            images = [im.to(device, non_blocking=True) for im in images]
            targets = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in t.items()} for t in targets]
            loss_dict = model(images, targets)
            loss = sum(loss_dict.values())
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 35.0)
            optimizer.step()
            scheduler.step()
            running += loss.detach()
            if (i + 1) % 20 == 0:
                dist.all_reduce(running)
                if rank == 0:
                    print(f"ep {epoch} [{i + 1}/{iters_per_epoch}] loss {running.item() / (20 * world):.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.5f} {time.time() - tic:.0f}s", flush=True)
                running.zero_()

        stats = evaluate(model.module, val_loader, val_set, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch}: bbox AP {stats['bbox']:.4f}  segm AP {stats['segm']:.4f}")
            is_best = stats["segm"] > best_ap
            best_ap = max(best_ap, stats["segm"])
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "best_ap": best_ap,
                     "num_classes": num_classes, "cat_ids": train_set.cat_ids}
            torch.save(state, os.path.join(args.out, "last.pth"))
            if is_best:
                torch.save(state, os.path.join(args.out, "best.pth"))
            with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, **stats}) + "\n")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
