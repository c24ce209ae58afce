"""BEVDepth with a Swin-T image backbone, lidar depth supervision and 2-frame temporal fusion.

Swin activations at 512x1408 do not fit in 80 GB at 2 samples/GPU, so the Swin
blocks run under activation checkpointing.

    torchrun --nproc_per_node=8 train_bevdepth_swin.py --data-root data/nuscenes \
        --work-dir work_dirs/bevdepth_swint_512x1408_2f
"""
import argparse
import logging
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.swin_transformer import SwinTransformerBlock

from av3d.datasets.pipelines import LoadMultiViewImages, PointToMultiViewDepth
from av3d.models.view_transform import DepthNetLSS, align_prev_bev
from av3d.models.heads import CenterHead
from av3d.eval import nuscenes_evaluate

CLASSES = ["car", "truck", "construction_vehicle", "bus", "trailer", "barrier",
           "motorcycle", "bicycle", "pedestrian", "traffic_cone"]
IMG_SIZE = (512, 1408)
logger = logging.getLogger("bevdepth")


class NuScenesTwoFrame(Dataset):
    def __init__(self, root, split, training):
        with open(os.path.join(root, f"bevdepth_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)
        self.load_imgs = LoadMultiViewImages(root, final_dim=IMG_SIZE, train=training)
        self.depth_gt = PointToMultiViewDepth(root, downsample=16, dbound=(2.0, 58.0, 0.5))
        self.training = training

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, i):
        info = self.infos[i]
        cur = self.load_imgs(info)
        prev_info = info.get("prev")  # None for the first keyframe of a scene
        prev = self.load_imgs(prev_info, aug=cur["aug"]) if prev_info is not None else None
        keep = np.isin(info["gt_names"], CLASSES)
        return {
            "imgs": cur["imgs"], "mats": cur["mats"], "depth": self.depth_gt(info, cur["mats"]),
            "prev_imgs": None if prev is None else prev["imgs"], "prev_mats": None if prev is None else prev["mats"],
            "ego_prev2cur": None if prev is None else torch.as_tensor(info["ego_prev2cur"], dtype=torch.float32),
            "gt_boxes": torch.as_tensor(info["gt_boxes"][keep], dtype=torch.float32),
            "gt_labels": torch.as_tensor([CLASSES.index(n) for n in info["gt_names"][keep]]),
            "token": info["token"],
        }


def collate_two_frame(batch):
    out = {"imgs": torch.stack([b["imgs"] for b in batch]),
           "mats": {k: torch.stack([b["mats"][k] for b in batch]) for k in batch[0]["mats"]},
           "depth": torch.stack([b["depth"] for b in batch]),
           "gt_boxes": [b["gt_boxes"] for b in batch], "gt_labels": [b["gt_labels"] for b in batch],
           "tokens": [b["token"] for b in batch]}
    has_prev = all(b["prev_imgs"] is not None for b in batch)
    out["prev_imgs"] = torch.stack([b["prev_imgs"] for b in batch]) if has_prev else None
    out["prev_mats"] = ({k: torch.stack([b["prev_mats"][k] for b in batch]) for k in batch[0]["prev_mats"]}
                        if has_prev else None)
    out["ego_prev2cur"] = torch.stack([b["ego_prev2cur"] for b in batch]) if has_prev else None
    return out


class SwinBackbone(nn.Module):
    def __init__(self, with_cp=True):
        super().__init__()
        swin = torchvision.models.swin_t(weights="IMAGENET1K_V1")
        self.features = swin.features  # [patch_embed, stage1, merge, stage2, merge, stage3, merge, stage4]
        self.with_cp = with_cp
        self.out_ids = (5, 7)  # stride 16 and 32

    def forward(self, x):
        outs = []
        for i, layer in enumerate(self.features):
            if self.with_cp and self.training and isinstance(layer, nn.Sequential) \
                    and isinstance(layer[0], SwinTransformerBlock):
                for blk in layer:
                    x = cp.checkpoint(blk, x)
            else:
                x = layer(x)
            if i in self.out_ids:
                outs.append(x.permute(0, 3, 1, 2).contiguous())
        return outs


class BEVDepthSwin(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = SwinBackbone(with_cp=True)
        self.neck = nn.Sequential(nn.Conv2d(384 + 768, 256, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True))
        self.depthnet = DepthNetLSS(in_channels=256, out_channels=80, mid_channels=256, image_size=IMG_SIZE,
                                    downsample=16, xbound=[-51.2, 51.2, 0.8], ybound=[-51.2, 51.2, 0.8],
                                    zbound=[-5, 3, 8], dbound=[2.0, 58.0, 0.5])
        self.temporal_fuse = nn.Sequential(nn.Conv2d(160, 80, 3, padding=1, bias=False), nn.BatchNorm2d(80), nn.ReLU(True))
        self.bev_encoder = nn.Sequential(*[m for c in (80, 160, 160) for m in
                                           (nn.Conv2d(c, 160, 3, padding=1, bias=False), nn.BatchNorm2d(160), nn.ReLU(True))])
        self.head = CenterHead(160, tasks=[["car"], ["truck", "construction_vehicle"], ["bus", "trailer"], ["barrier"],
                                           ["motorcycle", "bicycle"], ["pedestrian", "traffic_cone"]],
                               out_size_factor=4, bbox_code_size=9)

    def image_to_bev(self, imgs, mats):
        B, N = imgs.shape[:2]
        c4, c5 = self.backbone(imgs.flatten(0, 1))
        f = self.neck(torch.cat([c4, F.interpolate(c5, size=c4.shape[-2:], mode="bilinear")], 1))
        bev, depth = self.depthnet(f.view(B, N, *f.shape[1:]), mats)
        return bev, depth

    def forward(self, imgs, mats, prev_imgs=None, prev_mats=None, ego_prev2cur=None):
        bev, depth = self.image_to_bev(imgs, mats)
        if prev_imgs is not None:
            with torch.no_grad():
                prev_bev, _ = self.image_to_bev(prev_imgs, prev_mats)
            bev = self.temporal_fuse(torch.cat([bev, align_prev_bev(prev_bev, ego_prev2cur)], 1))
        return self.head(self.bev_encoder(bev)), depth


def depth_loss(depth_pred, depth_gt, dbound=(2.0, 58.0, 0.5)):
    D = depth_pred.shape[1]
    gt = depth_gt.flatten(0, 1)  # B*N, h, w (metric depth, 0 = no lidar return)
    valid = gt > 0
    bins = ((gt - dbound[0]) / dbound[2]).long().clamp(0, D - 1)
    pred = depth_pred.permute(0, 2, 3, 1)[valid]
    return F.binary_cross_entropy(pred.clamp(1e-4, 1 - 1e-4), F.one_hot(bins[valid], D).float(), reduction="mean")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="data/nuscenes")
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--epochs", type=int, default=24)
    ap.add_argument("--samples-per-gpu", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-4)  # for 8 x 2
    ap.add_argument("--depth-weight", type=float, default=3.0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    train_ds = NuScenesTwoFrame(args.data_root, "train", training=True)
    val_ds = NuScenesTwoFrame(args.data_root, "val", training=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.samples_per_gpu, sampler=sampler, num_workers=6,
                          collate_fn=collate_two_frame, pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=1, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=4,
                        collate_fn=collate_two_frame)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(BEVDepthSwin()).cuda()
    # temporal_fuse gets no gradient on batches without a previous keyframe
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-7)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[19 * len(train_dl), 23 * len(train_dl)], gamma=0.1)

    def to_cuda(b):
        mv = lambda d: None if d is None else {k: v.cuda(non_blocking=True) for k, v in d.items()}
        t = lambda x: None if x is None else x.cuda(non_blocking=True)
        return dict(imgs=t(b["imgs"]), mats=mv(b["mats"]), prev_imgs=t(b["prev_imgs"]), prev_mats=mv(b["prev_mats"]),
                    ego_prev2cur=t(b["ego_prev2cur"]))

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, b in enumerate(train_dl):
            preds, depth = model(**to_cuda(b))
            losses = model.module.head.loss([x.cuda() for x in b["gt_boxes"]], [x.cuda() for x in b["gt_labels"]], preds)
            losses["depth"] = args.depth_weight * depth_loss(depth, b["depth"].cuda(non_blocking=True))
            loss = sum(losses.values())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 50 == 0:
                logger.info("ep %d it %d/%d loss %.4f depth %.4f %.2fs/it", epoch, it, len(train_dl), loss.item(),
                            losses["depth"].item(), (time.time() - t0) / (it + 1))
        if rank == 0:
            torch.save({"state_dict": model.module.state_dict(), "epoch": epoch, "optimizer": opt.state_dict()},
                       os.path.join(args.work_dir, f"epoch_{epoch + 1}.pth"))
        if (epoch + 1) % 6 == 0:
            model.eval()
            res = {}
            with torch.no_grad():
                for b in val_dl:
                    preds, _ = model(**to_cuda(b))
                    for tok, det in zip(b["tokens"], model.module.head.get_bboxes(preds)):
                        res[tok] = {k: v.cpu() for k, v in det.items()}
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, res)
            if rank == 0:
                merged = {k: v for p in parts for k, v in p.items()}
                m = nuscenes_evaluate(merged, CLASSES, args.data_root, os.path.join(args.work_dir, f"eval_{epoch + 1}"))
                logger.info("epoch %d mAP %.4f NDS %.4f", epoch + 1, m["mAP"], m["NDS"])
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
