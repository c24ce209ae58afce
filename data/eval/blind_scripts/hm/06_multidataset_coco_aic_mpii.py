#!/usr/bin/env python3
# Joint training on COCO + AI Challenger + MPII with a shared backbone and one
# heatmap head per dataset (the skeletons differ: 17 / 14 / 16 joints).
#
#   torchrun --standalone --nproc_per_node=8 06_multidataset_coco_aic_mpii.py --config configs/multi_res50_256x192.json
import argparse
import itertools
import json
import logging
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from datasets import build_topdown_dataset
from datasets.utils import decode_heatmaps

log = logging.getLogger(__name__)

DATASETS = {
    "coco": dict(num_joints=17, weight=1.0),
    "aic": dict(num_joints=14, weight=0.5),
    "mpii": dict(num_joints=16, weight=0.5),
}


class SharedPoseNet(nn.Module):
    def __init__(self, backbone="resnet50", heads=DATASETS, deconv_channels=256):
        super().__init__()
        self.backbone = timm.create_model(backbone, pretrained=True, features_only=True, out_indices=(4,))
        in_ch = self.backbone.feature_info.channels()[-1]
        neck = []
        for _ in range(3):
            neck += [nn.ConvTranspose2d(in_ch, deconv_channels, 4, stride=2, padding=1, bias=False),
                     nn.BatchNorm2d(deconv_channels), nn.ReLU(inplace=True)]
            in_ch = deconv_channels
        self.neck = nn.Sequential(*neck)
        self.heads = nn.ModuleDict({name: nn.Conv2d(deconv_channels, spec["num_joints"], 1)
                                    for name, spec in heads.items()})

    def forward(self, x, dataset):
        feat = self.neck(self.backbone(x)[-1])
        return self.heads[dataset](feat)


def weighted_mse(pred, target, weight):
    w = weight.view(weight.shape[0], weight.shape[1], 1, 1)
    return 0.5 * F.mse_loss(pred * w, target * w)


class InfiniteLoader:
    """Cycles through a DataLoader and advances the DistributedSampler's epoch on every pass."""

    def __init__(self, loader, sampler):
        self.loader, self.sampler, self.epoch = loader, sampler, 0
        self.sampler.set_epoch(0)
        self.it = iter(loader)

    def next(self):
        try:
            return next(self.it)
        except StopIteration:
            self.epoch += 1
            self.sampler.set_epoch(self.epoch)
            self.it = iter(self.loader)
            return next(self.it)


@torch.no_grad()
def evaluate_coco(model, loader, coco, work_dir, tag):
    model.eval()
    dets = []
    for batch in loader:
        img = batch["img"].cuda(non_blocking=True)
        hm = model.module(img, "coco")
        kp = decode_heatmaps(hm.float().cpu().numpy(), batch["center"].numpy(), batch["scale"].numpy())
        for i in range(kp.shape[0]):
            conf = kp[i, :, 2]
            score = float(conf[conf > 0.2].mean()) if (conf > 0.2).any() else 0.0
            dets.append(dict(uid=int(batch["idx"][i]), image_id=int(batch["image_id"][i]), category_id=1,
                             keypoints=kp[i].reshape(-1).tolist(), score=score * float(batch["bbox_score"][i])))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, dets)
    if dist.get_rank() != 0:
        return None
    seen, results = set(), []
    for d in itertools.chain.from_iterable(parts):
        if d["uid"] in seen:
            continue
        seen.add(d["uid"])
        d.pop("uid")
        results.append(d)
    path = os.path.join(work_dir, f"coco_val_{tag}.json")
    json.dump(results, open(path, "w"))
    ev = COCOeval(coco, coco.loadRes(path), "keypoints")
    ev.params.useSegm = None
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return ev.stats[0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--work-dir", default="work_dirs/multi_res50")
    args = parser.parse_args()
    cfg = json.load(open(args.config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="[%(asctime)s] %(message)s")
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    iters = {}
    for name in DATASETS:
        ds = build_topdown_dataset(cfg["data"][name], train=True)
        sampler = DistributedSampler(ds, shuffle=True, seed=cfg.get("seed", 0))
        loader = DataLoader(ds, batch_size=cfg["batch_per_gpu"], sampler=sampler, num_workers=cfg["workers"],
                            pin_memory=True, drop_last=True, persistent_workers=True)
        iters[name] = InfiniteLoader(loader, sampler)
        log.info("%s: %d person instances", name, len(ds))
    val_ds = build_topdown_dataset(cfg["data"]["coco_val"], train=False)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=cfg["workers"], pin_memory=True)
    coco_val = COCO(cfg["data"]["coco_val"]["ann_file"]) if rank == 0 else None

    model = SharedPoseNet(cfg.get("backbone", "resnet50"))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg.get("weight_decay", 1e-4))
    total_iters = cfg["total_iters"]
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg["lr"], total_steps=total_iters,
                                                    pct_start=0.02, anneal_strategy="cos")

    names = list(DATASETS)
    best, t0 = 0.0, time.time()
    model.train()
    for step in range(total_iters):
        name = names[step % len(names)]
        batch = iters[name].next()
        img = batch["img"].cuda(non_blocking=True)
        target = batch["target"].cuda(non_blocking=True)
        weight = batch["target_weight"].cuda(non_blocking=True)

        pred = model(img, name)
        loss = DATASETS[name]["weight"] * weighted_mse(pred, target, weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()

        if step % 100 == 0:
            log.info("step %d/%d [%s] loss %.6f lr %.2e  %.1f it/s", step, total_iters, name, loss.item(),
                     scheduler.get_last_lr()[0], (step + 1) / (time.time() - t0))
        if (step + 1) % cfg["eval_every"] == 0 or step + 1 == total_iters:
            ap = evaluate_coco(model, val_loader, coco_val, args.work_dir, f"{step + 1}")
            model.train()
            if rank == 0:
                log.info("step %d: COCO val AP %.4f", step + 1, ap)
                state = {"step": step + 1, "model": model.module.state_dict(),
                         "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
                torch.save(state, os.path.join(args.work_dir, "latest.pth"))
                if ap > best:
                    best = ap
                    torch.save(model.module.state_dict(), os.path.join(args.work_dir, "best_coco_ap.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
