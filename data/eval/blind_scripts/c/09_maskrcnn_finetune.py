# -*- coding: utf-8 -*-
"""
Mask R-CNN 实例分割微调 (COCO 格式的自有数据, 如工业缺陷 / 细胞数据)
启动:
    torchrun --nproc_per_node=4 --master_port=29501 finetune_maskrcnn.py --cfg cfg/defect.yaml
"""
import os
import json
import time
import argparse
import datetime

import yaml
import numpy as np
from PIL import Image
from easydict import EasyDict as edict
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from pycocotools import mask as mask_utils

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision.models.detection import maskrcnn_resnet50_fpn_v2
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.models.detection.mask_rcnn import MaskRCNNPredictor
import torchvision.transforms.functional as TF


def init_dist():
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    dist.barrier(device_ids=[local_rank])
    return local_rank, dist.get_rank(), dist.get_world_size()


def print_rank0(*a):
    if dist.get_rank() == 0:
        print("[%s]" % datetime.datetime.now().strftime("%m-%d %H:%M:%S"), *a, flush=True)


class CocoInstance(Dataset):
    def __init__(self, img_dir, ann_file, train=True):
        self.img_dir, self.train = img_dir, train
        self.coco = COCO(ann_file)
        self.ids = sorted(self.coco.imgs.keys())
        if train:
            self.ids = [i for i in self.ids if len(self.coco.getAnnIds(imgIds=i, iscrowd=False)) > 0]
        self.cat_ids = sorted(self.coco.getCatIds())
        self.cat2label = {c: i + 1 for i, c in enumerate(self.cat_ids)}

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, idx):
        img_id = self.ids[idx]
        info = self.coco.imgs[img_id]
        img = Image.open(os.path.join(self.img_dir, info["file_name"])).convert("RGB")
        anns = self.coco.loadAnns(self.coco.getAnnIds(imgIds=img_id, iscrowd=False))
        boxes, labels, masks = [], [], []
        for a in anns:
            x, y, w, h = a["bbox"]
            if w < 1 or h < 1:
                continue
            boxes.append([x, y, x + w, y + h])
            labels.append(self.cat2label[a["category_id"]])
            masks.append(self.coco.annToMask(a))
        img = TF.to_tensor(img)
        target = {
            "boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
            "labels": torch.tensor(labels, dtype=torch.int64),
            "masks": torch.from_numpy(np.stack(masks)) if masks else torch.zeros(0, *img.shape[-2:], dtype=torch.uint8),
            "image_id": img_id,
        }
        if self.train and np.random.rand() < 0.5:
            img = img.flip(-1)
            target["boxes"][:, [0, 2]] = img.shape[-1] - target["boxes"][:, [2, 0]]
            target["masks"] = target["masks"].flip(-1)
        return img, target


def collate_fn(batch):
    return tuple(zip(*batch))


@torch.no_grad()
def evaluate(model, loader, dataset, out_dir, rank, world_size):
    model.eval()
    label2cat = {v: k for k, v in dataset.cat2label.items()}
    results = {}
    for imgs, targets in loader:
        outputs = model.module([im.cuda(non_blocking=True) for im in imgs])
        for out, t in zip(outputs, targets):
            masks = (out["masks"][:, 0] > 0.5).cpu().numpy().astype(np.uint8)
            dets = []
            for m, s, l in zip(masks, out["scores"].tolist(), out["labels"].tolist()):
                rle = mask_utils.encode(np.asfortranarray(m))
                rle["counts"] = rle["counts"].decode("ascii")
                dets.append({"image_id": t["image_id"], "category_id": label2cat[l],
                             "segmentation": rle, "score": s})
            results[t["image_id"]] = dets
    gathered = [None] * world_size
    dist.all_gather_object(gathered, results)
    model.train()
    if rank != 0:
        return 0.0
    merged = {}
    for part in gathered:  # 按 image_id 合并, 去掉 sampler 补齐的重复
        merged.update(part)
    dets = [d for v in merged.values() for d in v]
    if not dets:
        return 0.0
    res_file = os.path.join(out_dir, "segm_results.json")
    with open(res_file, "w") as f:
        json.dump(dets, f)
    E = COCOeval(dataset.coco, dataset.coco.loadRes(res_file), "segm")
    E.evaluate()
    E.accumulate()
    E.summarize()
    return float(E.stats[0])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", default="cfg/defect.yaml")
    parser.add_argument("--resume", default="")
    args = parser.parse_args()
    with open(args.cfg) as f:
        cfg = edict(yaml.safe_load(f))

    local_rank, rank, world_size = init_dist()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)

    train_set = CocoInstance(cfg.train_img, cfg.train_ann, train=True)
    val_set = CocoInstance(cfg.val_img, cfg.val_ann, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.seed)
    train_loader = DataLoader(train_set, batch_size=cfg.ims_per_gpu, sampler=train_sampler,
                              num_workers=cfg.workers, collate_fn=collate_fn, drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=cfg.workers, collate_fn=collate_fn)

    model = maskrcnn_resnet50_fpn_v2(weights="DEFAULT")
    num_classes = len(train_set.cat_ids) + 1
    in_feat = model.roi_heads.box_predictor.cls_score.in_features
    model.roi_heads.box_predictor = FastRCNNPredictor(in_feat, num_classes)
    model.roi_heads.mask_predictor = MaskRCNNPredictor(256, 256, num_classes)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        start_epoch = ckpt["epoch"] + 1
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    # base_lr 对应总 batch 16, 按实际总 batch 线性缩放
    lr = cfg.base_lr * cfg.ims_per_gpu * world_size / 16
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs)
    scaler = torch.cuda.amp.GradScaler(enabled=cfg.amp)
    if args.resume:
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])

    best_ap = 0.0
    for epoch in range(start_epoch, cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        meter = torch.zeros(2, device=device)
        for it, (imgs, targets) in enumerate(train_loader):
            imgs = [im.to(device, non_blocking=True) for im in imgs]
            targets = [{k: v.to(device) for k, v in t.items() if k != "image_id"} for t in targets]
            with torch.autocast("cuda", enabled=cfg.amp):
                loss_dict = model(imgs, targets)
                loss = sum(loss_dict.values())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            meter += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if it % cfg.log_interval == 0:
                print_rank0("epoch %d it %d/%d loss %.4f lr %.5f %.1fs" % (
                    epoch, it, len(train_loader), loss.item(), optimizer.param_groups[0]["lr"], time.time() - t0))
        scheduler.step()
        dist.all_reduce(meter)
        print_rank0("epoch %d 平均 loss (所有卡): %.4f" % (epoch, (meter[0] / meter[1]).item()))

        ap = evaluate(model, val_loader, val_set, cfg.out_dir, rank, world_size)
        if rank == 0:
            print_rank0("epoch %d segm AP: %.4f" % (epoch, ap))
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch}
            torch.save(ckpt, os.path.join(cfg.out_dir, "last.pth"))
            if ap > best_ap:
                best_ap = ap
                torch.save(ckpt, os.path.join(cfg.out_dir, "best.pth"))
        dist.barrier()

    print_rank0("训练完成, best segm AP %.4f" % best_ap)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
