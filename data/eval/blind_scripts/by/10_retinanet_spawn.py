"""RetinaNet training on a COCO-format pedestrian dataset (CrowdHuman full-body boxes).

One process per GPU is spawned from this script (ImageNet-example style launch):

    python retinanet_spawn.py --data /data/crowdhuman --dist-url tcp://127.0.0.1:29511 \
        --world-size 1 --rank 0
"""
import argparse
import os
import random
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils.data
import torchvision
from pycocotools.cocoeval import COCOeval
from torchvision.models.detection import retinanet_resnet50_fpn
from torchvision.models.detection.retinanet import RetinaNetClassificationHead
from torchvision.transforms import functional as TF

parser = argparse.ArgumentParser(description="RetinaNet CrowdHuman")
parser.add_argument("--data", required=True)
parser.add_argument("--epochs", default=30, type=int)
parser.add_argument("-b", "--batch-size", default=16, type=int, help="total over all GPUs of all nodes")
parser.add_argument("--lr", default=0.01, type=float)
parser.add_argument("--lr-steps", default=[20, 27], nargs="+", type=int)
parser.add_argument("--wd", default=1e-4, type=float)
parser.add_argument("-j", "--workers", default=4, type=int)
parser.add_argument("--world-size", default=1, type=int, help="number of nodes")
parser.add_argument("--rank", default=0, type=int, help="node rank")
parser.add_argument("--dist-url", default="tcp://127.0.0.1:29511", type=str)
parser.add_argument("--seed", default=None, type=int)
parser.add_argument("--output", default="checkpoints/retina_ch")
parser.add_argument("--resume", default="", type=str)


class CrowdHuman(torchvision.datasets.CocoDetection):
    def __init__(self, root, ann_file, train):
        super().__init__(root, ann_file)
        self.train = train
        if train:
            self.ids = [i for i in self.ids if self.coco.getAnnIds(imgIds=i, iscrowd=False)]

    def __getitem__(self, index):
        img, anns = super().__getitem__(index)
        anns = [a for a in anns if not a.get("iscrowd", 0) and a["bbox"][2] > 2 and a["bbox"][3] > 2]
        boxes = torch.as_tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        w, h = img.size
        boxes[:, 0::2] = boxes[:, 0::2].clamp(0, w)
        boxes[:, 1::2] = boxes[:, 1::2].clamp(0, h)
        img = TF.to_tensor(img)
        if self.train and random.random() < 0.5:
            img = img.flip(-1)
            boxes = torch.stack([w - boxes[:, 2], boxes[:, 1], w - boxes[:, 0], boxes[:, 3]], 1)
        target = {"boxes": boxes, "labels": torch.ones(len(boxes), dtype=torch.int64), "image_id": self.ids[index]}
        return img, target


def collate(batch):
    return tuple(zip(*batch))


def main():
    args = parser.parse_args()
    if args.seed is not None:
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        warnings.warn("Seeded training: cudnn.deterministic is not turned on, results may still vary.")
    ngpus_per_node = torch.cuda.device_count()
    args.world_size = ngpus_per_node * args.world_size
    os.makedirs(args.output, exist_ok=True)
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(args, ngpus_per_node))


def main_worker(gpu, ngpus_per_node, args):
    args.gpu = gpu
    args.rank = args.rank * ngpus_per_node + gpu
    torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend="nccl", init_method=args.dist_url, world_size=args.world_size, rank=args.rank)
    device = torch.device("cuda", args.gpu)
    is_main = args.rank == 0
    per_gpu_batch = args.batch_size // args.world_size
    workers = (args.workers + ngpus_per_node - 1) // ngpus_per_node

    model = retinanet_resnet50_fpn(weights="COCO_V1", min_size=800, max_size=1400,
                                   detections_per_img=300, topk_candidates=1000)
    num_anchors = model.head.classification_head.num_anchors
    model.head.classification_head = RetinaNetClassificationHead(256, num_anchors, num_classes=2)
    model.cuda(args.gpu)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=args.lr_steps, gamma=0.1)

    start_epoch = 0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location=f"cuda:{args.gpu}")
        model.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"]
        if is_main:
            print(f"=> resumed '{args.resume}' (epoch {start_epoch})")

    train_set = CrowdHuman(os.path.join(args.data, "Images"), os.path.join(args.data, "annotations/train.json"), True)
    val_set = CrowdHuman(os.path.join(args.data, "Images"), os.path.join(args.data, "annotations/val.json"), False)
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_set)
    val_sampler = torch.utils.data.distributed.DistributedSampler(val_set, shuffle=False)
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=per_gpu_batch, sampler=train_sampler,
                                               num_workers=workers, pin_memory=True, collate_fn=collate,
                                               drop_last=True)
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=1, sampler=val_sampler, num_workers=workers,
                                             collate_fn=collate)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train(train_loader, model, optimizer, epoch, device, is_main)
        scheduler.step()
        ap = validate(val_loader, model.module, val_set.coco, device)
        if is_main:
            print(f" * epoch {epoch} AP {ap[0]:.4f} AP50 {ap[1]:.4f}")
            torch.save({"epoch": epoch + 1, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                       os.path.join(args.output, "checkpoint.pth.tar"))
        dist.barrier()
    dist.destroy_process_group()


def warmup_factor(it, warmup=500):
    return 0.001 + (1 - 0.001) * min(it, warmup) / warmup


def train(loader, model, optimizer, epoch, device, is_main):
    model.train()
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    end = time.time()
    for i, (images, targets) in enumerate(loader):
        if epoch == 0:
            f = warmup_factor(i)
            for g, lr in zip(optimizer.param_groups, base_lrs):
                g["lr"] = lr * f
        images = [im.to(device, non_blocking=True) for im in images]
        targets = [{"boxes": t["boxes"].to(device), "labels": t["labels"].to(device)} for t in targets]
        losses = model(images, targets)
        loss = losses["classification"] + losses["bbox_regression"]
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        optimizer.step()

        if i % 20 == 0:
            vals = torch.stack([losses["classification"].detach(), losses["bbox_regression"].detach()])
            dist.all_reduce(vals)
            vals /= dist.get_world_size()
            if is_main:
                print(f"Epoch [{epoch}][{i}/{len(loader)}] cls {vals[0]:.4f} reg {vals[1]:.4f} "
                      f"lr {optimizer.param_groups[0]['lr']:.5f} time {time.time() - end:.2f}s", flush=True)
            end = time.time()
    if epoch == 0:
        for g, lr in zip(optimizer.param_groups, base_lrs):
            g["lr"] = lr


@torch.no_grad()
def validate(loader, model, coco_gt, device):
    model.eval()
    per_image = {}
    for images, targets in loader:
        outputs = model([im.to(device) for im in images])
        for t, o in zip(targets, outputs):
            b = o["boxes"].cpu().numpy()
            b[:, 2:] -= b[:, :2]
            per_image[t["image_id"]] = [
                {"image_id": t["image_id"], "category_id": 1, "bbox": [float(v) for v in bb], "score": float(s)}
                for bb, s in zip(b, o["scores"].tolist())]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, per_image)
    if dist.get_rank() != 0:
        return np.zeros(12)
    merged = {}
    for g in gathered:
        merged.update(g)
    dets = [d for v in merged.values() for d in v]
    E = COCOeval(coco_gt, coco_gt.loadRes(dets), "bbox")
    E.params.imgIds = sorted(merged)
    E.params.maxDets = [1, 100, 300]
    E.evaluate()
    E.accumulate()
    E.summarize()
    return E.stats


if __name__ == "__main__":
    main()
