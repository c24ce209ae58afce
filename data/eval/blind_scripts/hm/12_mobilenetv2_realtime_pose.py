"""Lightweight top-down pose model (MobileNetV2 + 3 deconvs) for the on-device tracker.

Training: torchrun --nproc_per_node=8 12_mobilenetv2_realtime_pose.py --data /mnt/datasets/coco --amp
"""
import argparse
import json
import logging
import os
import random
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from kpt.dataset import TopDownCOCO
from kpt.postprocess import heatmaps_to_keypoints, flip_heatmaps
from kpt.metrics import coco_oks_ap

logging.basicConfig(format="%(asctime)s [%(levelname)s] %(message)s", level=logging.INFO)
log = logging.getLogger("mbv2pose")


def get_args():
    parser = argparse.ArgumentParser("mobilenetv2 pose")
    parser.add_argument("--data", default="/mnt/datasets/coco")
    parser.add_argument("--input-size", default="192x256")
    parser.add_argument("--width-mult", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--epochs", type=int, default=210)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--save-dir", default="checkpoints/mbv2_pose")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--seed", type=int, default=2023)
    return parser.parse_args()


class MobilePose(nn.Module):
    def __init__(self, width_mult=1.0, num_joints=17):
        super().__init__()
        name = "mobilenetv2_100" if width_mult == 1.0 else f"mobilenetv2_{int(width_mult * 100)}"
        self.backbone = timm.create_model(name, pretrained=True, features_only=True, out_indices=(4,))
        c = self.backbone.feature_info.channels()[-1]
        layers = []
        for out_c in (256, 256, 256):
            layers += [nn.ConvTranspose2d(c, out_c, 4, 2, 1, bias=False), nn.BatchNorm2d(out_c), nn.ReLU(inplace=True)]
            c = out_c
        self.deconv = nn.Sequential(*layers)
        self.final = nn.Conv2d(c, num_joints, 1)

    def forward(self, x):
        return self.final(self.deconv(self.backbone(x)[0]))


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train_epoch(model, loader, optimizer, scheduler, scaler, epoch, args, rank):
    model.train()
    meter, n, t0 = 0.0, 0, time.time()
    for step, (img, target, weight, _) in enumerate(loader):
        img = img.cuda(non_blocking=True)
        target = target.cuda(non_blocking=True)
        weight = weight.cuda(non_blocking=True)
        with torch.cuda.amp.autocast(enabled=args.amp):
            out = model(img)
        w = weight.unsqueeze(-1)
        loss = 0.5 * ((out.float() * w - target * w) ** 2).mean()
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        meter += loss.item()
        n += 1
        if rank == 0 and step % 100 == 0:
            log.info("epoch %d step %d/%d loss %.6f lr %.2e (%.2f it/s)", epoch, step, len(loader), meter / n,
                     optimizer.param_groups[0]["lr"], (step + 1) / (time.time() - t0))
    return meter / max(n, 1)


@torch.no_grad()
def evaluate(model, loader, ann_file, save_dir, epoch, rank):
    model.eval()
    dets = []
    for img, _, _, meta in loader:
        img = img.cuda(non_blocking=True)
        hm = model(img)
        hm = (hm + flip_heatmaps(model(img.flip(3)))) / 2
        kpts = heatmaps_to_keypoints(hm.float().cpu().numpy(), meta["center"].numpy(), meta["scale"].numpy())
        for i in range(len(kpts)):
            dets.append({"sample": int(meta["index"][i]), "image_id": int(meta["image_id"][i]),
                         "keypoints": kpts[i].reshape(-1).tolist(), "box_score": float(meta["box_score"][i])})
    all_dets = [None] * dist.get_world_size()
    dist.all_gather_object(all_dets, dets)
    if rank != 0:
        return None
    merged = {d["sample"]: d for part in all_dets for d in part}
    return coco_oks_ap(ann_file, list(merged.values()), os.path.join(save_dir, f"val_ep{epoch}.json"))


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    seed_all(args.seed + rank)
    if rank != 0:
        log.setLevel(logging.WARNING)
    w, h = map(int, args.input_size.split("x"))

    train_set = TopDownCOCO(args.data, "train2017", (w, h), is_train=True)
    val_set = TopDownCOCO(args.data, "val2017", (w, h), is_train=False)
    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_set, num_replicas=world, rank=rank, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=128, sampler=val_sampler, num_workers=args.workers, pin_memory=True)

    model = MobilePose(args.width_mult)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=steps, pct_start=0.01,
                                                    div_factor=100, final_div_factor=100)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        log.info("world size %d, %d train crops, %d iters/epoch", world, len(train_set), len(train_loader))
    best_ap = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        train_loss = train_epoch(model, train_loader, optimizer, scheduler, scaler, epoch, args, rank)
        stats = None
        if epoch % 5 == 4 or epoch == args.epochs - 1:
            stats = evaluate(model, val_loader, os.path.join(args.data, "annotations/person_keypoints_val2017.json"),
                             args.save_dir, epoch, rank)
        if rank == 0:
            log.info("epoch %d train loss %.6f %s", epoch, train_loss, json.dumps(stats) if stats else "")
            ckpt = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "args": vars(args)}
            torch.save(ckpt, os.path.join(args.save_dir, "last.pt"))
            if stats and stats["AP"] > best_ap:
                best_ap = stats["AP"]
                torch.save(model.module.state_dict(), os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    if rank == 0:
        log.info("done, best AP %.4f", best_ap)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
