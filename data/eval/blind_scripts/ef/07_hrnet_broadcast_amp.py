"""HRNet-W32 trainer for the broadcast-camera keypoint set (mixed precision).

Broadcast crops are small (players far from the camera), so we train at
256x192 with sigma 2 and mixed precision to fit batch 64 per GPU.

    torchrun --nproc_per_node=8 hrnet_broadcast_amp.py --config configs/broadcast_w32.yaml
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from sportpose.data import TopDownCocoDataset
from sportpose.transforms import flip_back, get_final_preds

FLIP_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]
DEFAULTS = {
    "ann_train": "/mnt/broadcast/ann/train.json",
    "ann_val": "/mnt/broadcast/ann/val.json",
    "img_dir": "/mnt/broadcast/frames",
    "work_dir": "/mnt/broadcast/work/w32_amp",
    "epochs": 120,
    "batch_size": 64,
    "lr": 2e-3,
    "weight_decay": 1e-4,
    "warmup_epochs": 2,
    "workers": 10,
    "eval_interval": 5,
}

log = logging.getLogger("train")


class PoseNet(nn.Module):
    def __init__(self, num_joints=17):
        super().__init__()
        self.backbone = timm.create_model("hrnet_w32", pretrained=True, features_only=True,
                                          feature_location="", out_indices=(1,))
        self.final_layer = nn.Conv2d(self.backbone.feature_info.channels()[0], num_joints, 1)

    def forward(self, x):
        return self.final_layer(self.backbone(x)[0])


def joints_mse(out, target, weight):
    b, k = out.shape[:2]
    diff = (out.float().reshape(b, k, -1) - target.reshape(b, k, -1)) * weight
    return 0.5 * diff.pow(2).mean()


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        if self.rank == 0:
            os.makedirs(cfg["work_dir"], exist_ok=True)

        common = dict(image_size=[192, 256], sigma=2, flip_pairs=FLIP_PAIRS)
        self.train_ds = TopDownCocoDataset(None, cfg["ann_train"], cfg["img_dir"], train=True, **common)
        self.val_ds = TopDownCocoDataset(None, cfg["ann_val"], cfg["img_dir"], train=False, **common)
        self.train_sampler = DistributedSampler(self.train_ds, shuffle=True)
        self.train_dl = DataLoader(self.train_ds, batch_size=cfg["batch_size"], sampler=self.train_sampler,
                                   num_workers=cfg["workers"], pin_memory=True, drop_last=True,
                                   persistent_workers=True)
        self.val_dl = DataLoader(self.val_ds, batch_size=128, sampler=DistributedSampler(self.val_ds, shuffle=False),
                                 num_workers=cfg["workers"], pin_memory=True)

        model = nn.SyncBatchNorm.convert_sync_batchnorm(PoseNet()).to(self.device)
        self.model = DDP(model, device_ids=[self.local_rank])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
        iters = cfg["epochs"] * len(self.train_dl)
        warm = cfg["warmup_epochs"] * len(self.train_dl)
        self.scheduler = torch.optim.lr_scheduler.OneCycleLR(self.optimizer, max_lr=cfg["lr"], total_steps=iters,
                                                             pct_start=warm / iters, anneal_strategy="cos")
        self.scaler = torch.cuda.amp.GradScaler()
        self.best_ap = 0.0

    def train_epoch(self, epoch):
        self.model.train()
        self.train_sampler.set_epoch(epoch)
        stats = torch.zeros(2, device=self.device)
        t0 = time.time()
        for it, (img, target, weight, _) in enumerate(self.train_dl):
            img = img.to(self.device, non_blocking=True)
            target = target.to(self.device, non_blocking=True)
            weight = weight.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = self.model(img)
            loss = joints_mse(out, target, weight)
            if not torch.isfinite(loss):
                log.warning("rank %d: non-finite loss at epoch %d it %d, skipping batch", self.rank, epoch, it)
                self.optimizer.zero_grad(set_to_none=True)
                continue
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 5.0)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.scheduler.step()
            stats += torch.stack([loss.detach(), torch.ones((), device=self.device)])
            if it % 100 == 0 and self.rank == 0:
                log.info("ep %d it %d/%d loss %.6f lr %.2e", epoch, it, len(self.train_dl), loss.item(),
                         self.scheduler.get_last_lr()[0])
        dist.all_reduce(stats)
        if self.rank == 0:
            log.info("ep %d done: loss %.6f (%.0fs)", epoch, (stats[0] / stats[1]).item(), time.time() - t0)

    @torch.no_grad()
    def validate(self, epoch):
        self.model.eval()
        rows = []
        for img, _, _, meta in self.val_dl:
            img = img.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                hm = self.model(img).float()
                hm_f = self.model(img.flip(3)).float()
            hm_f = torch.from_numpy(flip_back(hm_f.cpu().numpy(), FLIP_PAIRS).copy()).to(self.device)
            hm_f[..., 1:] = hm_f.clone()[..., :-1]
            heat = ((hm + hm_f) * 0.5).cpu().numpy()
            preds, conf = get_final_preds(heat, meta["center"].numpy(), meta["scale"].numpy())
            for n in range(len(preds)):
                ok = conf[n, :, 0] > 0.2
                rows.append({"index": int(meta["index"][n]), "image_id": int(meta["image_id"][n]),
                             "category_id": 1, "score": float(conf[n, ok, 0].mean()) if ok.any() else 0.0,
                             "keypoints": np.concatenate([preds[n], conf[n]], axis=1).ravel().tolist()})
        gathered = [None] * self.world
        dist.all_gather_object(gathered, rows)
        ap = torch.zeros(1, device=self.device)
        if self.rank == 0:
            merged = {}
            for part in gathered:
                for r in part:
                    merged[r.pop("index")] = r
            path = os.path.join(self.cfg["work_dir"], f"val_ep{epoch}.json")
            with open(path, "w") as f:
                json.dump(list(merged.values()), f)
            gt = self.val_ds.coco
            E = COCOeval(gt, gt.loadRes(path), "keypoints")
            E.params.useSegm = None
            E.evaluate()
            E.accumulate()
            E.summarize()
            ap[0] = E.stats[0]
        dist.broadcast(ap, 0)
        return ap.item()

    def save(self, epoch, ap):
        if self.rank != 0:
            return
        state = {"epoch": epoch, "model": self.model.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(), "ap": ap}
        torch.save(state, os.path.join(self.cfg["work_dir"], "latest.pth"))
        if ap > self.best_ap:
            self.best_ap = ap
            torch.save(state["model"], os.path.join(self.cfg["work_dir"], "best_ap.pth"))

    def fit(self):
        for epoch in range(self.cfg["epochs"]):
            self.train_epoch(epoch)
            ap = 0.0
            if (epoch + 1) % self.cfg["eval_interval"] == 0:
                ap = self.validate(epoch)
                if self.rank == 0:
                    log.info("ep %d AP %.4f", epoch, ap)
            self.save(epoch, ap)
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="")
    args = ap.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    Trainer(cfg).fit()


if __name__ == "__main__":
    main()
