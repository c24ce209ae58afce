# -*- coding: utf-8 -*-
# FCOS 目标检测训练 (torchvision 实现), COCO 格式数据
# 用法:
#   python -m torch.distributed.launch --nproc_per_node=8 tools/train_fcos.py --data-root data/coco
import os
import json
import time
import random
import argparse
import datetime

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel
import torchvision
from torchvision.models.detection import fcos_resnet50_fpn
import torchvision.transforms.functional as TF
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval


def get_args():
    parser = argparse.ArgumentParser("FCOS training")
    parser.add_argument("--data-root", default="data/coco")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=2, help="每张卡的 batch")
    parser.add_argument("--lr", type=float, default=0.01, help="lr for 8 gpus x 2 imgs")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=-1)
    parser.add_argument("--output-dir", default="work_dirs/fcos_r50_1x")
    # launch 老版本传 --local_rank, 2.x 传 --local-rank, 两个都接
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0)
    return parser.parse_args()


def init_distributed(args):
    dist.init_process_group(backend="nccl", init_method="env://")
    args.rank = dist.get_rank()
    args.world_size = dist.get_world_size()
    # 所有进程使用 rank0 的随机种子
    seed = args.seed if args.seed >= 0 else random.randint(0, 2 ** 31 - 1)
    seed_t = torch.tensor([seed], dtype=torch.int64).cuda()
    dist.broadcast(seed_t, src=0)
    torch.cuda.set_device(args.local_rank)
    args.seed = int(seed_t.item())
    random.seed(args.seed + args.rank)
    np.random.seed(args.seed + args.rank)
    torch.manual_seed(args.seed + args.rank)


def log(args, msg):
    if args.rank == 0:
        print("[{}] {}".format(datetime.datetime.now().strftime("%H:%M:%S"), msg), flush=True)


class CocoDet(torchvision.datasets.CocoDetection):
    def __init__(self, img_dir, ann_file, train=True):
        super().__init__(img_dir, ann_file)
        self.train = train
        self.cat_ids = sorted(self.coco.getCatIds())
        self.cat2label = {c: i + 1 for i, c in enumerate(self.cat_ids)}
        if train:  # 去掉没有标注的图片
            self.ids = [i for i in self.ids if len(self.coco.getAnnIds(imgIds=i, iscrowd=False)) > 0]

    def __getitem__(self, idx):
        img, anns = super().__getitem__(idx)
        anns = [a for a in anns if a.get("iscrowd", 0) == 0 and a["bbox"][2] > 1 and a["bbox"][3] > 1]
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        labels = torch.tensor([self.cat2label[a["category_id"]] for a in anns], dtype=torch.int64)
        img = TF.to_tensor(img)
        if self.train and random.random() < 0.5:
            img = img.flip(-1)
            w = img.shape[-1]
            boxes[:, [0, 2]] = w - boxes[:, [2, 0]]
        return img, {"boxes": boxes, "labels": labels, "image_id": self.ids[idx]}


def collate_fn(batch):
    return tuple(zip(*batch))


@torch.no_grad()
def evaluate(model, loader, dataset, args):
    model.eval()
    label2cat = {v: k for k, v in dataset.cat2label.items()}
    results = {}
    for imgs, targets in loader:
        imgs = [im.cuda(non_blocking=True) for im in imgs]
        outputs = model.module(imgs)
        for out, tgt in zip(outputs, targets):
            boxes = out["boxes"].cpu()
            boxes[:, 2:] -= boxes[:, :2]
            results[tgt["image_id"]] = [
                {"image_id": tgt["image_id"], "category_id": label2cat[l],
                 "bbox": [round(x, 2) for x in b], "score": round(s, 4)}
                for b, s, l in zip(boxes.tolist(), out["scores"].tolist(), out["labels"].tolist())]
    # 每个 rank 的结果收集到一起
    all_results = [None] * args.world_size
    dist.all_gather_object(all_results, results)
    model.train()
    if args.rank != 0:
        return 0.0
    # DistributedSampler 会补齐样本, 按 image_id 去重
    merged_dict = {}
    for part in all_results:
        merged_dict.update(part)
    merged = [r for dets in merged_dict.values() for r in dets]
    if len(merged) == 0:
        return 0.0
    res_file = os.path.join(args.output_dir, "bbox_results.json")
    with open(res_file, "w") as f:
        json.dump(merged, f)
    coco_dt = dataset.coco.loadRes(res_file)
    coco_eval = COCOeval(dataset.coco, coco_dt, "bbox")
    coco_eval.evaluate()
    coco_eval.accumulate()
    coco_eval.summarize()
    return coco_eval.stats[0]


def main():
    args = get_args()
    init_distributed(args)
    if args.rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    log(args, "args: {}".format(vars(args)))

    train_set = CocoDet(os.path.join(args.data_root, "train2017"),
                        os.path.join(args.data_root, "annotations/instances_train2017.json"), train=True)
    val_set = CocoDet(os.path.join(args.data_root, "val2017"),
                      os.path.join(args.data_root, "annotations/instances_val2017.json"), train=False)
    train_sampler = DistributedSampler(train_set)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, collate_fn=collate_fn, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=val_sampler,
                            num_workers=args.workers, collate_fn=collate_fn)

    model = fcos_resnet50_fpn(weights=None, weights_backbone="IMAGENET1K_V1", num_classes=len(train_set.cat_ids) + 1)
    model.cuda()
    model = DistributedDataParallel(model, device_ids=[args.local_rank])

    # lr 参数是按 16 张图给的, 按实际总 batch 缩放
    lr = args.lr * args.batch_size * args.world_size / 16
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
    iters_per_epoch = len(train_loader)
    milestones = [8 * iters_per_epoch, 11 * iters_per_epoch]
    warmup_iters = 500

    def lr_lambda(it):
        if it < warmup_iters:
            return 1.0 / 3 + (1 - 1.0 / 3) * it / warmup_iters
        return 0.1 ** sum(it >= m for m in milestones)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (imgs, targets) in enumerate(train_loader):
            imgs = [im.cuda(non_blocking=True) for im in imgs]
            targets = [{"boxes": t["boxes"].cuda(), "labels": t["labels"].cuda()} for t in targets]
            loss_dict = model(imgs, targets)
            loss = sum(loss_dict.values())
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 35.0)
            optimizer.step()
            scheduler.step()
            if it % 50 == 0:
                # 日志里的 loss 取所有卡的平均
                reduced = torch.stack([v.detach() for v in loss_dict.values()])
                dist.all_reduce(reduced)
                reduced /= args.world_size
                msg = " ".join("{}: {:.4f}".format(k, v) for k, v in zip(loss_dict.keys(), reduced.tolist()))
                log(args, "epoch {} iter {}/{} {} lr {:.5f} ({:.1f}s)".format(
                    epoch, it, iters_per_epoch, msg, optimizer.param_groups[0]["lr"], time.time() - t0))
        if args.rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.output_dir, "epoch_{}.pth".format(epoch + 1)))
        ap = evaluate(model, val_loader, val_set, args)
        log(args, "epoch {} bbox mAP: {:.4f}".format(epoch, ap))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
