"""PETR (position embedding transformation) for multi-view 3D detection, nuScenes.

torchrun --nproc_per_node=8 petr_train.py --cfg cfgs/petr_r50_800x320_24e.yaml
"""
import argparse
import math
import os
import pickle
import time
from dataclasses import dataclass, field
from typing import List

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from av3d.models.heads import PETRHead
from av3d.eval import nuscenes_evaluate


@dataclass
class Cfg:
    data_root: str = "data/nuscenes"
    work_dir: str = "work_dirs/petr_r50"
    classes: List[str] = field(default_factory=lambda: [
        "car", "truck", "construction_vehicle", "bus", "trailer", "barrier",
        "motorcycle", "bicycle", "pedestrian", "traffic_cone"])
    img_size: List[int] = field(default_factory=lambda: [320, 800])
    samples_per_gpu: int = 1
    epochs: int = 24
    lr: float = 2e-4
    backbone_lr_mult: float = 0.1
    warmup_iters: int = 500
    num_queries: int = 900
    depth_bins: int = 64
    eval_interval: int = 4


CAMS = ["CAM_FRONT", "CAM_FRONT_RIGHT", "CAM_FRONT_LEFT", "CAM_BACK", "CAM_BACK_LEFT", "CAM_BACK_RIGHT"]


class MultiViewNuScenes(Dataset):
    def __init__(self, cfg: Cfg, split: str, training: bool):
        with open(os.path.join(cfg.data_root, f"nuscenes_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)["infos"]
        self.cfg = cfg
        self.training = training
        self.mean = torch.tensor([103.530, 116.280, 123.675]).view(3, 1, 1)
        self.std = torch.tensor([57.375, 57.120, 58.395]).view(3, 1, 1)

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, idx):
        info = self.infos[idx]
        H, W = self.cfg.img_size
        imgs, lidar2img = [], []
        for cam in CAMS:
            c = info["cams"][cam]
            img = Image.open(os.path.join(self.cfg.data_root, c["data_path"])).convert("RGB")
            scale = W / img.width
            newh = int(img.height * scale)
            img = img.resize((W, newh), Image.BILINEAR).crop((0, newh - H, W, newh))
            t = torch.from_numpy(np.asarray(img, dtype=np.float32)[..., ::-1].copy()).permute(2, 0, 1)  # BGR
            imgs.append((t - self.mean) / self.std)
            K = np.eye(4)
            K[:3, :3] = c["cam_intrinsic"]
            aug = np.eye(4)
            aug[0, 0] = aug[1, 1] = scale
            aug[1, 3] = -(newh - H)
            lidar2img.append((aug @ K @ np.linalg.inv(c["sensor2lidar"])).astype(np.float32))
        keep = np.isin(info["gt_names"], self.cfg.classes)
        boxes = info["gt_boxes"][keep].astype(np.float32)
        labels = np.array([self.cfg.classes.index(n) for n in info["gt_names"][keep]], dtype=np.int64)
        meta = {"token": info["token"], "lidar2img": np.stack(lidar2img), "img_shape": (H, W)}
        return torch.stack(imgs), torch.from_numpy(boxes), torch.from_numpy(labels), meta


def collate_mv(batch):
    imgs, boxes, labels, metas = zip(*batch)
    return torch.stack(imgs), list(boxes), list(labels), list(metas)


class GridMask(nn.Module):
    def __init__(self, prob=0.7, ratio=0.5):
        super().__init__()
        self.prob, self.ratio = prob, ratio

    def forward(self, x):
        if not self.training or np.random.rand() > self.prob:
            return x
        n, c, h, w = x.shape
        d = np.random.randint(2, h)
        l = int(d * self.ratio + 0.5)
        mask = torch.ones(h, w, device=x.device)
        st_h, st_w = np.random.randint(d), np.random.randint(d)
        for i in range(-1, h // d + 1):
            s = d * i + st_h
            mask[max(s, 0):max(min(s + l, h), 0)] = 0
        for i in range(-1, w // d + 1):
            s = d * i + st_w
            mask[:, max(s, 0):max(min(s + l, w), 0)] = 0
        return x * mask


class PETR(nn.Module):
    def __init__(self, cfg: Cfg):
        super().__init__()
        r50 = torchvision.models.resnet50(weights="IMAGENET1K_V2", norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.backbone = nn.Sequential(r50.conv1, r50.bn1, r50.relu, r50.maxpool, r50.layer1, r50.layer2,
                                      r50.layer3, r50.layer4)
        self.neck = nn.Conv2d(2048, 256, 1)
        self.grid_mask = GridMask()
        self.head = PETRHead(num_classes=len(cfg.classes), in_channels=256, num_query=cfg.num_queries,
                             depth_num=cfg.depth_bins, position_range=[-61.2, -61.2, -10.0, 61.2, 61.2, 10.0],
                             num_decoder_layers=6, code_size=10)

    def forward(self, imgs, metas):
        B, N = imgs.shape[:2]
        x = self.grid_mask(imgs.flatten(0, 1))
        feats = self.neck(self.backbone(x))  # stride 32
        feats = feats.view(B, N, *feats.shape[1:])
        return self.head(feats, metas)


def build_optimizer(model, cfg):
    bb = [p for n, p in model.named_parameters() if n.startswith("backbone.") and p.requires_grad]
    rest = [p for n, p in model.named_parameters() if not n.startswith("backbone.") and p.requires_grad]
    return torch.optim.AdamW([{"params": bb, "lr": cfg.lr * cfg.backbone_lr_mult}, {"params": rest, "lr": cfg.lr}],
                             lr=cfg.lr, weight_decay=0.01)


def lr_lambda(total, warmup):
    def f(it):
        if it < warmup:
            return 1.0 / 3 + (1 - 1.0 / 3) * it / warmup
        return 1e-3 + (1 - 1e-3) * 0.5 * (1 + math.cos(math.pi * (it - warmup) / (total - warmup)))
    return f


@torch.no_grad()
def evaluate(model, loader, cfg, epoch, writer):
    model.eval()
    results = {}
    for imgs, _, _, metas in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            outs = model(imgs.cuda(non_blocking=True), metas)
        bbox_list = model.head.get_bboxes(outs, metas)
        for meta, dets in zip(metas, bbox_list):
            results[meta["token"]] = {k: v.float().cpu() for k, v in dets.items()}
    chunks = [None] * dist.get_world_size()
    dist.all_gather_object(chunks, results)
    if dist.get_rank() == 0:
        merged = {k: v for c in chunks for k, v in c.items()}
        m = nuscenes_evaluate(merged, cfg.classes, cfg.data_root, os.path.join(cfg.work_dir, f"eval_{epoch}"))
        for k in ("mAP", "NDS", "mATE", "mASE", "mAOE", "mAVE", "mAAE"):
            writer.add_scalar(f"val/{k}", m[k], epoch)
        print(f"[epoch {epoch}] mAP {m['mAP']:.4f} NDS {m['NDS']:.4f}", flush=True)
    model.train()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    cfg = Cfg()
    if args.cfg:
        with open(args.cfg) as f:
            for k, v in yaml.safe_load(f).items():
                setattr(cfg, k, v)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.manual_seed(42)
    writer = None
    if rank == 0:
        os.makedirs(cfg.work_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(cfg.work_dir, "tf_logs"))

    train_ds = MultiViewNuScenes(cfg, "train", training=True)
    val_ds = MultiViewNuScenes(cfg, "val", training=False)
    sampler = DistributedSampler(train_ds)
    train_loader = DataLoader(train_ds, batch_size=cfg.samples_per_gpu, sampler=sampler, num_workers=4,
                              collate_fn=collate_mv, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4, collate_fn=collate_mv)

    model = PETR(cfg).cuda()
    model = DDP(model, device_ids=[local_rank])
    optimizer = build_optimizer(model.module, cfg)
    total = cfg.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total, cfg.warmup_iters))
    scaler = torch.cuda.amp.GradScaler(init_scale=512.0)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"]

    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (imgs, boxes, labels, metas) in enumerate(train_loader):
            with torch.autocast("cuda", dtype=torch.float16):
                outs = model(imgs.cuda(non_blocking=True), metas)
            losses = model.module.head.loss([b.cuda() for b in boxes], [l.cuda() for l in labels], outs)
            loss = sum(losses.values())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), 35.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if rank == 0 and it % 50 == 0:
                step = epoch * len(train_loader) + it
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/grad_norm", gnorm.item(), step)
                for k, v in losses.items():
                    writer.add_scalar(f"train/{k}", v.item(), step)
                print(f"ep {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f} "
                      f"{(time.time() - tic) / (it + 1):.3f}s/it", flush=True)
        if rank == 0:
            torch.save({"state_dict": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch + 1},
                       os.path.join(cfg.work_dir, f"epoch_{epoch + 1}.pth"))
        dist.barrier()
        if (epoch + 1) % cfg.eval_interval == 0 or epoch + 1 == cfg.epochs:
            evaluate(model, val_loader, cfg, epoch + 1, writer)

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
