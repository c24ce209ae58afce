"""Detectron2-style iteration-based trainer for torchvision Faster R-CNN R50-FPN v2 (COCO 3x).

    torchrun --nproc_per_node=8 frcnn_iter_schedule.py --data /datasets/coco --output output/frcnn_3x
"""
import argparse
import itertools
import logging
import os
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torchvision
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset, Sampler
from torchvision.models.detection import fasterrcnn_resnet50_fpn_v2
from torchvision.transforms import v2 as T

CFG = {
    "SOLVER": {
        "IMS_PER_BATCH": 16,  # images per batch across all machines
        "BASE_LR": 0.02,
        "MOMENTUM": 0.9,
        "WEIGHT_DECAY": 1e-4,
        "MAX_ITER": 270000,
        "STEPS": (210000, 250000),
        "GAMMA": 0.1,
        "WARMUP_ITERS": 1000,
        "WARMUP_FACTOR": 1.0 / 1000,
        "CHECKPOINT_PERIOD": 10000,
    },
    "INPUT": {"MIN_SIZE_TRAIN": (640, 672, 704, 736, 768, 800), "MAX_SIZE_TRAIN": 1333, "MIN_SIZE_TEST": 800},
    "TEST": {"EVAL_PERIOD": 30000},
    "DATALOADER": {"NUM_WORKERS": 4},
    "SEED": 13,
}

log = logging.getLogger("train")


class TrainingSampler(Sampler):
    """Infinite shuffled index stream, sharded across ranks from a shared seed."""

    def __init__(self, size, seed):
        self.size, self.seed = size, seed
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def _infinite(self):
        g = torch.Generator()
        g.manual_seed(self.seed)
        while True:
            yield from torch.randperm(self.size, generator=g).tolist()

    def __iter__(self):
        yield from itertools.islice(self._infinite(), self.rank, None, self.world)


class InferenceSampler(Sampler):
    def __init__(self, size):
        rank, world = dist.get_rank(), dist.get_world_size()
        shard = (size - 1) // world + 1
        self.indices = range(rank * shard, min((rank + 1) * shard, size))

    def __iter__(self):
        yield from self.indices

    def __len__(self):
        return len(self.indices)


class AspectRatioGroupedDataset(IterableDataset):
    """Groups landscape and portrait images into separate batches."""

    def __init__(self, loader, batch_size):
        self.loader, self.batch_size = loader, batch_size
        self._buckets = [[], []]

    def __iter__(self):
        for img, tgt in self.loader:
            h, w = img.shape[-2:]
            bucket = self._buckets[0 if w > h else 1]
            bucket.append((img, tgt))
            if len(bucket) == self.batch_size:
                batch = bucket[:]
                del bucket[:]
                yield tuple(zip(*batch))


def build_dataset(root, split, train):
    ops = [T.ToImage()]
    if train:
        ops += [T.RandomShortestSize(CFG["INPUT"]["MIN_SIZE_TRAIN"], CFG["INPUT"]["MAX_SIZE_TRAIN"]),
                T.RandomHorizontalFlip()]
    ops += [T.ToDtype(torch.float32, scale=True), T.SanitizeBoundingBoxes()]
    ds = torchvision.datasets.CocoDetection(f"{root}/{split}2017", f"{root}/annotations/instances_{split}2017.json",
                                            transforms=T.Compose(ops))
    if train:
        ds.ids = [i for i in ds.ids if len(ds.coco.getAnnIds(imgIds=i, iscrowd=False)) > 0]
    return torchvision.datasets.wrap_dataset_for_transforms_v2(ds, target_keys=["boxes", "labels", "image_id"])


def build_train_loader(dataset, cfg):
    sampler = TrainingSampler(len(dataset), cfg["SEED"])
    per_image = DataLoader(dataset, sampler=sampler, batch_size=None, num_workers=cfg["DATALOADER"]["NUM_WORKERS"],
                           pin_memory=True)
    return AspectRatioGroupedDataset(per_image, cfg["SOLVER"]["IMS_PER_BATCH"])


def lr_multiplier(it, s):
    if it < s["WARMUP_ITERS"]:
        a = it / s["WARMUP_ITERS"]
        warm = s["WARMUP_FACTOR"] * (1 - a) + a
    else:
        warm = 1.0
    return warm * s["GAMMA"] ** int(np.searchsorted(s["STEPS"], it, side="right"))


@torch.no_grad()
def inference_on_dataset(model, dataset, device):
    model.eval()
    loader = DataLoader(dataset, sampler=InferenceSampler(len(dataset)), batch_size=1, num_workers=4,
                        collate_fn=lambda b: tuple(zip(*b)))
    preds = []
    for imgs, tgts in loader:
        outs = model([im.to(device) for im in imgs])
        for t, o in zip(tgts, outs):
            b = o["boxes"].cpu()
            b[:, 2:] -= b[:, :2]
            preds += [{"image_id": int(t["image_id"]), "category_id": int(c), "bbox": bb, "score": float(s)}
                      for bb, s, c in zip(b.tolist(), o["scores"].tolist(), o["labels"].tolist())]
    all_preds = [None] * dist.get_world_size()
    dist.all_gather_object(all_preds, preds)
    model.train()
    if dist.get_rank() != 0:
        return {}
    preds = list(itertools.chain(*all_preds))
    coco_gt = dataset.coco
    E = COCOeval(coco_gt, coco_gt.loadRes(preds), "bbox")
    E.evaluate()
    E.accumulate()
    E.summarize()
    return dict(zip(["AP", "AP50", "AP75", "APs", "APm", "APl"], E.stats[:6].tolist()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/datasets/coco")
    ap.add_argument("--output", default="output/frcnn_3x")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="[%(asctime)s %(name)s]: %(message)s", datefmt="%m/%d %H:%M:%S")
    s = CFG["SOLVER"]

    train_set = build_dataset(args.data, "train", True)
    val_set = build_dataset(args.data, "val", False)
    train_loader = build_train_loader(train_set, CFG)

    model = fasterrcnn_resnet50_fpn_v2(weights=None, weights_backbone="IMAGENET1K_V1", num_classes=91,
                                       min_size=CFG["INPUT"]["MIN_SIZE_TEST"], max_size=1333)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank], broadcast_buffers=False)

    norm_params, other_params = [], []
    for m in model.modules():
        for p in m.parameters(recurse=False):
            if not p.requires_grad:
                continue
            (norm_params if isinstance(m, torch.nn.modules.batchnorm._NormBase) else other_params).append(p)
    optimizer = torch.optim.SGD([{"params": other_params, "weight_decay": s["WEIGHT_DECAY"]},
                                 {"params": norm_params, "weight_decay": 0.0}], lr=s["BASE_LR"], momentum=s["MOMENTUM"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: lr_multiplier(it, s))

    start_iter = 0
    last = os.path.join(args.output, "model_final.pth")
    ckpts = sorted(f for f in os.listdir(args.output) if f.startswith("model_0")) if os.path.isdir(args.output) else []
    if args.resume and ckpts:
        state = torch.load(os.path.join(args.output, ckpts[-1]), map_location="cpu")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_iter = state["iteration"] + 1
        log.info(f"Resuming from {ckpts[-1]} at iteration {start_iter}")
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)

    log.info(f"Starting training from iteration {start_iter}")
    ddp.train()
    meters = defaultdict(float)
    t0 = time.perf_counter()
    for it, (images, targets) in zip(range(start_iter, s["MAX_ITER"]), train_loader):
        images = [im.to(device, non_blocking=True) for im in images]
        targets = [{"boxes": t["boxes"].to(device), "labels": t["labels"].to(device)} for t in targets]
        loss_dict = ddp(images, targets)
        losses = sum(loss_dict.values())
        optimizer.zero_grad()
        losses.backward()
        optimizer.step()
        scheduler.step()

        if (it + 1) % 20 == 0:
            v = torch.stack([x.detach() for x in loss_dict.values()])
            dist.all_reduce(v, op=dist.ReduceOp.AVG)
            if rank == 0:
                dt = (time.perf_counter() - t0) / 20
                eta = dt * (s["MAX_ITER"] - it - 1) / 3600
                log.info(f"iter: {it + 1}  total_loss: {v.sum():.3f}  "
                         + "  ".join(f"{k}: {x:.3f}" for k, x in zip(loss_dict, v.tolist()))
                         + f"  time: {dt:.3f}  lr: {scheduler.get_last_lr()[0]:.5f}  eta: {eta:.1f}h")
            t0 = time.perf_counter()

        if (it + 1) % s["CHECKPOINT_PERIOD"] == 0 or it + 1 == s["MAX_ITER"]:
            if rank == 0:
                name = "model_final.pth" if it + 1 == s["MAX_ITER"] else f"model_{it:07d}.pth"
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "iteration": it}, os.path.join(args.output, name))
            dist.barrier()

        if (it + 1) % CFG["TEST"]["EVAL_PERIOD"] == 0 or it + 1 == s["MAX_ITER"]:
            res = inference_on_dataset(model, val_set, device)
            if rank == 0:
                log.info(f"Evaluation results for bbox at iter {it + 1}: {res}")
            dist.barrier()

    log.info(f"done, final weights at {last}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
