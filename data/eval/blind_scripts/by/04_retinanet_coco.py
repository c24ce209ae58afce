#!/usr/bin/env python3
# RetinaNet R50-FPN (v2 weights recipe) on COCO 2017, 1x/3x schedule.
#   torchrun --standalone --nproc_per_node=8 retinanet_coco.py --cfg 1x --work-dir work/retina_1x
import argparse
import json
import logging
import os
import time
from itertools import chain

import torch
import torch.distributed as dist
import torchvision
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.models.detection import retinanet_resnet50_fpn_v2
from torchvision.transforms import v2 as T
from torchvision import tv_tensors
from pycocotools.cocoeval import COCOeval

SCHEDULES = {
    # iterations are for a global batch of 16 images
    "1x": dict(max_iter=90000, steps=(60000, 80000)),
    "3x": dict(max_iter=270000, steps=(210000, 250000)),
}

logger = logging.getLogger("retinanet")


def setup_logging(work_dir, rank):
    level = logging.INFO if rank == 0 else logging.WARNING
    fmt = logging.Formatter("[%(asctime)s] %(message)s", datefmt="%m/%d %H:%M:%S")
    logger.setLevel(level)
    sh = logging.StreamHandler()
    sh.setFormatter(fmt)
    logger.addHandler(sh)
    if rank == 0:
        fh = logging.FileHandler(os.path.join(work_dir, "log.txt"))
        fh.setFormatter(fmt)
        logger.addHandler(fh)


def build_transforms(train):
    ops = [T.ToImage()]
    if train:
        ops += [T.RandomShortestSize(min_size=(640, 672, 704, 736, 768, 800), max_size=1333),
                T.RandomHorizontalFlip(0.5)]
    ops += [T.ToDtype(torch.float32, scale=True), T.SanitizeBoundingBoxes()]
    return T.Compose(ops)


def build_dataset(root, split, train):
    ds = torchvision.datasets.CocoDetection(
        os.path.join(root, f"{split}2017"), os.path.join(root, "annotations", f"instances_{split}2017.json"),
        transforms=build_transforms(train))
    if train:
        # images without any non-crowd box give no training signal for RetinaNet
        ds.ids = [i for i in ds.ids if len(ds.coco.getAnnIds(imgIds=i, iscrowd=False)) > 0]
    ds = torchvision.datasets.wrap_dataset_for_transforms_v2(ds, target_keys=("boxes", "labels", "image_id"))
    return ds


def collate(batch):
    return tuple(zip(*batch))


class InfiniteSampler(DistributedSampler):
    """DistributedSampler that keeps yielding; epoch is bumped every pass."""

    def __iter__(self):
        while True:
            yield from super().__iter__()
            self.set_epoch(self.epoch + 1)


def warmup_multistep(it, warmup_iters, steps, warmup_factor=0.001, gamma=0.1):
    if it < warmup_iters:
        alpha = it / warmup_iters
        return warmup_factor * (1 - alpha) + alpha
    return gamma ** sum(it >= s for s in steps)


@torch.no_grad()
def run_eval(model, loader, coco_gt, device):
    model.eval()
    dets = {}
    for images, targets in loader:
        images = [im.to(device) for im in images]
        outputs = model(images)
        for tgt, out in zip(targets, outputs):
            img_id = int(tgt["image_id"])
            b = out["boxes"].cpu()
            b[:, 2:] -= b[:, :2]
            dets[img_id] = [dict(image_id=img_id, category_id=int(c), bbox=[round(x, 2) for x in bb], score=float(s))
                            for bb, s, c in zip(b.tolist(), out["scores"].tolist(), out["labels"].tolist())]
    all_dets = [None for _ in range(dist.get_world_size())]
    dist.all_gather_object(all_dets, dets)
    if dist.get_rank() != 0:
        return None
    merged = {}
    for d in all_dets:
        merged.update(d)
    results = list(chain.from_iterable(merged.values()))
    coco_eval = COCOeval(coco_gt, coco_gt.loadRes(results), "bbox")
    coco_eval.params.imgIds = sorted(merged)
    coco_eval.evaluate()
    coco_eval.accumulate()
    coco_eval.summarize()
    return {"AP": coco_eval.stats[0], "AP50": coco_eval.stats[1], "AP75": coco_eval.stats[2]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="/mnt/datasets/coco")
    ap.add_argument("--cfg", default="1x", choices=list(SCHEDULES))
    ap.add_argument("--work-dir", default="work/retinanet")
    ap.add_argument("--ims-per-gpu", type=int, default=2)
    ap.add_argument("--base-lr", type=float, default=0.01)
    ap.add_argument("--warmup-iters", type=int, default=1000)
    ap.add_argument("--eval-period", type=int, default=10000)
    ap.add_argument("--ckpt-period", type=int, default=5000)
    ap.add_argument("--resume", default="", help="path to a checkpoint, or 'auto' for work-dir/last_checkpoint")
    ap.add_argument("--num-workers", type=int, default=4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
    dist.barrier()
    setup_logging(args.work_dir, rank)

    sched = SCHEDULES[args.cfg]
    ims_per_batch = args.ims_per_gpu * world
    scale = 16 / ims_per_batch
    max_iter = int(sched["max_iter"] * scale)
    steps = [int(s * scale) for s in sched["steps"]]
    lr = args.base_lr * ims_per_batch / 16
    logger.info(f"world={world} ims_per_batch={ims_per_batch} lr={lr} max_iter={max_iter} steps={steps}")

    train_ds = build_dataset(args.data_root, "train", True)
    val_ds = build_dataset(args.data_root, "val", False)
    train_loader = DataLoader(train_ds, batch_size=args.ims_per_gpu, sampler=InfiniteSampler(train_ds, seed=0),
                              num_workers=args.num_workers, collate_fn=collate, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=args.num_workers, collate_fn=collate)

    model = retinanet_resnet50_fpn_v2(weights=None, weights_backbone="IMAGENET1K_V2", num_classes=91)
    model.to(device)
    ddp_model = DistributedDataParallel(model, device_ids=[local_rank])

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 else decay).append(p)
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": 1e-4},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda it: warmup_multistep(it, args.warmup_iters, steps))

    start_iter = 0
    resume = args.resume
    if resume == "auto":
        marker = os.path.join(args.work_dir, "last_checkpoint")
        resume = open(marker).read().strip() if os.path.exists(marker) else ""
    if resume:
        ckpt = torch.load(resume)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_iter = ckpt["iteration"] + 1
        logger.info(f"resumed from {resume} at iter {start_iter}")

    writer = SummaryWriter(os.path.join(args.work_dir, "tb")) if rank == 0 else None
    train_loader.sampler.set_epoch(start_iter // max(1, len(train_ds) // ims_per_batch))
    data_iter = iter(train_loader)
    ddp_model.train()
    t_start = time.perf_counter()
    for it in range(start_iter, max_iter):
        images, targets = next(data_iter)
        images = [im.to(device, non_blocking=True) for im in images]
        targets = [{"boxes": t["boxes"].to(device), "labels": t["labels"].to(device)} for t in targets]

        loss_dict = ddp_model(images, targets)
        loss = sum(loss_dict.values())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()

        if (it + 1) % 20 == 0:
            stats = torch.stack([v.detach() for v in loss_dict.values()])
            dist.all_reduce(stats, op=dist.ReduceOp.AVG)
            if rank == 0:
                el = time.perf_counter() - t_start
                eta = el / (it + 1 - start_iter) * (max_iter - it - 1)
                msg = " ".join(f"{k}={v:.4f}" for k, v in zip(loss_dict.keys(), stats.tolist()))
                logger.info(f"iter {it + 1}/{max_iter} lr={scheduler.get_last_lr()[0]:.5f} {msg} eta={eta / 3600:.1f}h")
                for k, v in zip(loss_dict.keys(), stats.tolist()):
                    writer.add_scalar(f"train/{k}", v, it + 1)

        if (it + 1) % args.ckpt_period == 0 or it + 1 == max_iter:
            if rank == 0:
                path = os.path.join(args.work_dir, f"model_{it + 1:07d}.pth")
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "iteration": it}, path)
                with open(os.path.join(args.work_dir, "last_checkpoint"), "w") as f:
                    f.write(path)
            dist.barrier()

        if (it + 1) % args.eval_period == 0 or it + 1 == max_iter:
            res = run_eval(model, val_loader, val_ds.coco, device)
            if rank == 0:
                logger.info(json.dumps(res))
                for k, v in res.items():
                    writer.add_scalar(f"val/{k}", v, it + 1)
            model.train()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
