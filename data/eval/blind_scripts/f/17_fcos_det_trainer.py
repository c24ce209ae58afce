"""FCOS-R50-FPN trainer with hooks, EMA, AMP and gradient clipping (mmdet-like layout, torchvision model).

    torchrun --nproc_per_node=8 tools/train_fcos.py configs/fcos_r50_fpn_1x_coco.yaml --work-dir work_dirs/fcos
"""
import argparse
import json
import math
import os
import os.path as osp
import time
from copy import deepcopy

import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import CocoDetection, wrap_dataset_for_transforms_v2
from torchvision.models.detection import fcos_resnet50_fpn
from torchvision.transforms import v2 as T


class ModelEMA:
    """Exponential moving average of the bare model's weights (YOLOX / timm style)."""

    def __init__(self, model, decay=0.9998, tau=2000):
        self.ema = deepcopy(model).eval()
        self.updates = 0
        self.decay = lambda x: decay * (1 - math.exp(-x / tau))
        for p in self.ema.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        self.updates += 1
        d = self.decay(self.updates)
        msd = model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(d).add_(msd[k].detach(), alpha=1 - d)


class Hook:
    priority = 50

    def before_epoch(self, trainer):
        pass

    def after_iter(self, trainer):
        pass

    def after_epoch(self, trainer):
        pass


class DistSamplerSeedHook(Hook):
    priority = 0

    def before_epoch(self, trainer):
        trainer.train_sampler.set_epoch(trainer.epoch)


class TextLoggerHook(Hook):
    def __init__(self, interval):
        self.interval = interval

    def after_iter(self, trainer):
        if trainer.iter % self.interval:
            return
        vals = torch.stack([trainer.outputs[k] for k in sorted(trainer.outputs)])
        dist.all_reduce(vals, op=dist.ReduceOp.AVG)
        if trainer.rank == 0:
            s = ", ".join(f"{k}: {v:.4f}" for k, v in zip(sorted(trainer.outputs), vals.tolist()))
            print(f"Epoch [{trainer.epoch + 1}][{trainer.inner_iter}/{trainer.iters_per_epoch}] "
                  f"lr: {trainer.optimizer.param_groups[0]['lr']:.4e}, {s}", flush=True)


class CheckpointHook(Hook):
    priority = 90

    def after_epoch(self, trainer):
        if trainer.rank == 0:
            torch.save({"meta": {"epoch": trainer.epoch + 1, "iter": trainer.iter},
                        "state_dict": trainer.model.module.state_dict(),
                        "ema": trainer.ema.ema.state_dict(),
                        "optimizer": trainer.optimizer.state_dict()},
                       osp.join(trainer.work_dir, f"epoch_{trainer.epoch + 1}.pth"))
        dist.barrier()


class ShardSampler(Sampler):
    """Evaluation sampler: contiguous shard per rank, no duplicated images."""

    def __init__(self, n, rank, world_size):
        per = int(math.ceil(n / world_size))
        self.indices = list(range(rank * per, min(n, (rank + 1) * per)))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def collate(batch):
    return tuple(zip(*batch))


@torch.no_grad()
def evaluate(model, loader, coco_gt, device, rank, world_size, work_dir):
    model.eval()
    results = []
    for images, targets in loader:
        images = [im.to(device, non_blocking=True) for im in images]
        for out, tgt in zip(model(images), targets):
            boxes = out["boxes"].cpu()
            boxes[:, 2:] -= boxes[:, :2]
            for b, s, l in zip(boxes.tolist(), out["scores"].tolist(), out["labels"].tolist()):
                results.append({"image_id": tgt["image_id"], "category_id": l, "bbox": b, "score": s})
    gathered = [None] * world_size
    dist.all_gather_object(gathered, results)
    stats = None
    if rank == 0:
        from pycocotools.cocoeval import COCOeval
        merged = [r for part in gathered for r in part]
        res_file = osp.join(work_dir, "results.bbox.json")
        with open(res_file, "w") as f:
            json.dump(merged, f)
        coco_eval = COCOeval(coco_gt, coco_gt.loadRes(res_file), "bbox")
        coco_eval.evaluate()
        coco_eval.accumulate()
        coco_eval.summarize()
        stats = coco_eval.stats[0]
    dist.barrier()
    return stats


class Trainer:
    def __init__(self, cfg, work_dir):
        self.cfg, self.work_dir = cfg, work_dir
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        if self.rank == 0:
            os.makedirs(work_dir, exist_ok=True)

        tf_train = T.Compose([T.ToImage(), T.RandomHorizontalFlip(), T.ToDtype(torch.float32, scale=True),
                              T.SanitizeBoundingBoxes()])
        tf_val = T.Compose([T.ToImage(), T.ToDtype(torch.float32, scale=True)])
        d = cfg["data"]
        train_set = wrap_dataset_for_transforms_v2(CocoDetection(d["train_img"], d["train_ann"], transforms=tf_train),
                                                   target_keys=("boxes", "labels", "image_id"))
        train_set._dataset.ids = [i for i in train_set._dataset.ids
                                  if train_set._dataset.coco.getAnnIds(imgIds=i, iscrowd=False)]
        val_raw = CocoDetection(d["val_img"], d["val_ann"], transforms=tf_val)
        self.coco_gt = val_raw.coco
        val_set = wrap_dataset_for_transforms_v2(val_raw, target_keys=("image_id",))
        self.train_sampler = DistributedSampler(train_set, shuffle=True, seed=cfg["seed"])
        self.train_loader = DataLoader(train_set, batch_size=cfg["samples_per_gpu"], sampler=self.train_sampler,
                                       num_workers=cfg["workers_per_gpu"], collate_fn=collate, pin_memory=True,
                                       drop_last=True)
        self.val_loader = DataLoader(val_set, batch_size=2, sampler=ShardSampler(len(val_set), self.rank, self.world_size),
                                     num_workers=cfg["workers_per_gpu"], collate_fn=collate)

        model = fcos_resnet50_fpn(weights=None, weights_backbone="IMAGENET1K_V1", num_classes=91)
        model.to(self.device)
        torch.manual_seed(cfg["seed"] + self.rank)  # per-rank augmentation randomness; DDP syncs weights below
        self.ema = ModelEMA(model)
        self.model = DDP(model, device_ids=[self.local_rank])

        base_lr = cfg["lr"] * cfg["samples_per_gpu"] * self.world_size / 16
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD(params, lr=base_lr, momentum=0.9, weight_decay=1e-4)
        self.iters_per_epoch = len(self.train_loader)
        self.max_iters = cfg["epochs"] * self.iters_per_epoch
        warm, steps = cfg["warmup_iters"], [int(self.max_iters * 8 / 12), int(self.max_iters * 11 / 12)]
        self.lr_lambda = lambda it: (it / warm * 0.999 + 0.001 if it < warm else 1.0) * 0.1 ** sum(it >= s for s in steps)
        self.scaler = torch.cuda.amp.GradScaler(enabled=cfg["fp16"])
        self.hooks = sorted([DistSamplerSeedHook(), TextLoggerHook(50), CheckpointHook()], key=lambda h: h.priority)
        self.epoch = self.iter = self.inner_iter = 0
        self.outputs = {}
        if cfg.get("resume_from"):
            ckpt = torch.load(cfg["resume_from"], map_location="cpu")
            self.model.module.load_state_dict(ckpt["state_dict"])
            self.ema.ema.load_state_dict(ckpt["ema"])
            self.optimizer.load_state_dict(ckpt["optimizer"])
            self.epoch, self.iter = ckpt["meta"]["epoch"], ckpt["meta"]["iter"]

    def call(self, name):
        for h in self.hooks:
            getattr(h, name)(self)

    def run(self):
        while self.epoch < self.cfg["epochs"]:
            self.model.train()
            self.call("before_epoch")
            for self.inner_iter, (images, targets) in enumerate(self.train_loader):
                for g in self.optimizer.param_groups:
                    g["lr"] = g.setdefault("initial_lr", g["lr"]) * self.lr_lambda(self.iter)
                images = [im.to(self.device, non_blocking=True) for im in images]
                targets = [{"boxes": t["boxes"].to(self.device), "labels": t["labels"].to(self.device)} for t in targets]
                with torch.autocast("cuda", enabled=self.cfg["fp16"]):
                    losses = self.model(images, targets)
                    loss = sum(losses.values())
                self.optimizer.zero_grad(set_to_none=True)
                self.scaler.scale(loss).backward()
                self.scaler.unscale_(self.optimizer)
                nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=35, norm_type=2)
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.ema.update(self.model.module)
                self.outputs = {k: v.detach() for k, v in losses.items()}
                self.iter += 1
                self.call("after_iter")
            self.call("after_epoch")
            if (self.epoch + 1) % self.cfg["eval_interval"] == 0:
                m = evaluate(self.ema.ema, self.val_loader, self.coco_gt, self.device, self.rank,
                             self.world_size, self.work_dir)
                if self.rank == 0:
                    print(f"Epoch {self.epoch + 1} EMA bbox_mAP: {m:.4f}", flush=True)
            self.epoch += 1
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--work-dir", default="work_dirs/fcos_r50_fpn_1x")
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    Trainer(cfg, args.work_dir).run()


if __name__ == "__main__":
    main()
