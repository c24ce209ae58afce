"""Faster R-CNN MobileNetV3-Large FPN on BDD100K (10 classes, COCO-format labels), with EMA weights.

    torchrun --nproc_per_node=4 frcnn_mobilenet_ema.py --root /data/bdd100k --out ckpt/bdd_mnv3
"""
import argparse
import math
import os
import time
from copy import deepcopy

import torch
import torch.distributed as dist
import torchvision
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_fpn
from torchvision.transforms import v2 as T

BDD_CLASSES = ["pedestrian", "rider", "car", "truck", "bus", "train", "motorcycle", "bicycle",
               "traffic light", "traffic sign"]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/bdd100k")
    ap.add_argument("--out", default="ckpt/bdd_mnv3")
    ap.add_argument("--epochs", type=int, default=24)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.04)
    ap.add_argument("--warmup-epochs", type=float, default=1.0)
    ap.add_argument("--ema-decay", type=float, default=0.9995)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--patience", type=int, default=6, help="stop after this many evals without improvement")
    return ap.parse_args()


def get_dataset(root, split, train):
    t = [T.ToImage()]
    if train:
        t += [T.RandomHorizontalFlip(), T.RandomPhotometricDistort(p=0.3)]
    t += [T.ToDtype(torch.float32, scale=True), T.SanitizeBoundingBoxes()]
    ds = torchvision.datasets.CocoDetection(os.path.join(root, "images/100k", split),
                                            os.path.join(root, "labels", f"det_{split}_coco.json"),
                                            transforms=T.Compose(t))
    if train:
        ds.ids = [i for i in ds.ids if ds.coco.getAnnIds(imgIds=i)]
    return torchvision.datasets.wrap_dataset_for_transforms_v2(ds, target_keys=("boxes", "labels", "image_id"))


def collate(batch):
    return tuple(zip(*batch))


class ModelEma:
    def __init__(self, model, decay):
        self.ema = deepcopy(model).eval()
        self.decay = decay
        for p in self.ema.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model, step):
        d = min(self.decay, (1 + step) / (10 + step))
        msd = model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(d).add_(msd[k], alpha=1 - d)
            else:
                v.copy_(msd[k])


@torch.no_grad()
def evaluate(model, loader, coco_gt, device):
    model.eval()
    dets = {}
    for imgs, tgts in loader:
        outs = model([i.to(device) for i in imgs])
        for t, o in zip(tgts, outs):
            iid = int(t["image_id"])
            b = o["boxes"].cpu()
            b[:, 2:] -= b[:, :2]
            dets[iid] = [{"image_id": iid, "category_id": int(c), "bbox": bb, "score": float(s)}
                         for bb, s, c in zip(b.tolist(), o["scores"].tolist(), o["labels"].tolist())]
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, dets)
    ap = [0.0]
    if dist.get_rank() == 0:
        merged = {}
        for s in shards:
            merged.update(s)
        res = [d for v in merged.values() for d in v]
        if res:
            E = COCOeval(coco_gt, coco_gt.loadRes(res), "bbox")
            E.params.imgIds = sorted(merged)
            E.evaluate()
            E.accumulate()
            E.summarize()
            ap = [float(E.stats[0])]
    dist.broadcast_object_list(ap, src=0)
    return ap[0]


def save_checkpoint(path, model, ema, optimizer, scheduler, epoch, best_ap):
    torch.save({"model": model.state_dict(), "ema": ema.ema.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "epoch": epoch, "best_ap": best_ap}, path)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    os.makedirs(args.out, exist_ok=True)

    train_ds = get_dataset(args.root, "train", True)
    val_ds = get_dataset(args.root, "val", False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          collate_fn=collate, pin_memory=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=8, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=args.workers, collate_fn=collate)

    model = fasterrcnn_mobilenet_v3_large_fpn(weights=None, weights_backbone="IMAGENET1K_V1",
                                              num_classes=len(BDD_CLASSES) + 1, min_size=720, max_size=1280)
    model.to(device)
    ddp_model = DDP(model, device_ids=[local_rank])
    ema = ModelEma(model, args.ema_decay)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=4e-5)
    steps_per_epoch = len(train_dl)
    total = args.epochs * steps_per_epoch
    warm = int(args.warmup_epochs * steps_per_epoch)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    best_ap, bad_evals, step = 0.0, 0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        t0 = time.time()
        for i, (imgs, tgts) in enumerate(train_dl):
            imgs = [im.to(device, non_blocking=True) for im in imgs]
            tgts = [{"boxes": t["boxes"].to(device), "labels": t["labels"].to(device)} for t in tgts]
            loss_dict = ddp_model(imgs, tgts)
            loss = sum(loss_dict.values())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            ema.update(model, step)
            if i % 100 == 0:
                l = torch.stack([v.detach() for v in loss_dict.values()])
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"[{epoch}/{args.epochs}][{i}/{steps_per_epoch}] loss {l.sum():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.5f} ({time.time() - t0:.0f}s)", flush=True)

        ap = evaluate(ema.ema, val_dl, val_ds.coco, device)
        if rank == 0:
            print(f"epoch {epoch}: EMA mAP {ap:.4f} (best {best_ap:.4f})", flush=True)
        save_checkpoint(os.path.join(args.out, "last.pth"), model, ema, optimizer, scheduler, epoch, best_ap)
        if ap > best_ap:
            best_ap, bad_evals = ap, 0
            save_checkpoint(os.path.join(args.out, "best.pth"), model, ema, optimizer, scheduler, epoch, best_ap)
        else:
            bad_evals += 1
        if bad_evals >= args.patience:
            if rank == 0:
                print(f"no improvement for {bad_evals} epochs, stopping", flush=True)
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
