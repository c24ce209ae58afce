# BEVFusion (camera + lidar) with TransFusion head and camera-dropout robustness training.
#
# Robustness recipe (see design doc "sensor failure"): during training the camera stream
# is dropped for a whole batch with probability `cam_dropout`, so the fused model
# keeps lidar-only performance when a camera ECU fails.
#
#   torchrun --nproc_per_node=8 train_bevfusion_robust.py --cam-dropout 0.25 \
#       --load-lidar ckpt/transfusion_l_nus.pth --work-dir work_dirs/bevfusion_camdrop25
#
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from av3d.datasets.pipelines import LoadMultiViewImages, LoadPointsWithSweeps, ImageAug3D, GlobalRotScaleTrans
from av3d.models.backbones import SwinTransformerT, GeneralizedLSSFPN, SECONDBackbone, SECONDFPN
from av3d.models.lidar import SparseEncoder, HardVoxelize
from av3d.models.view_transform import DepthLSSTransform
from av3d.models.heads import TransFusionHead
from av3d.eval import nuscenes_evaluate

CLASSES = ["car", "truck", "construction_vehicle", "bus", "trailer", "barrier",
           "motorcycle", "bicycle", "pedestrian", "traffic_cone"]
log = logging.getLogger("bevfusion")


class NuScenesFusion(Dataset):
    def __init__(self, root, split, train):
        with open(os.path.join(root, f"nuscenes_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)["infos"]
        self.load_imgs = LoadMultiViewImages(root, final_dim=(256, 704))
        self.load_pts = LoadPointsWithSweeps(root, sweeps_num=9, use_dim=5)
        self.img_aug = ImageAug3D(final_dim=(256, 704), resize_lim=(0.38, 0.55) if train else (0.48, 0.48),
                                  rot_lim=(-5.4, 5.4) if train else (0, 0), rand_flip=train)
        self.bev_aug = GlobalRotScaleTrans(rot=(-0.785, 0.785), scale=(0.9, 1.1), translate_std=0.5) if train else None
        self.train = train

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, i):
        info = self.infos[i]
        data = {"token": info["token"], "gt_boxes": info["gt_boxes"][np.isin(info["gt_names"], CLASSES)],
                "gt_labels": np.array([CLASSES.index(n) for n in info["gt_names"] if n in CLASSES], np.int64)}
        data.update(self.load_imgs(info))
        data.update(self.load_pts(info))
        data = self.img_aug(data)
        if self.bev_aug is not None:
            data = self.bev_aug(data)
        return data


def fusion_collate(batch):
    out = {
        "img": torch.stack([torch.as_tensor(b["img"]) for b in batch]),  # B, 6, 3, H, W
        "camera2lidar": torch.stack([torch.as_tensor(b["camera2lidar"]) for b in batch]),
        "camera_intrinsics": torch.stack([torch.as_tensor(b["camera_intrinsics"]) for b in batch]),
        "img_aug_matrix": torch.stack([torch.as_tensor(b["img_aug_matrix"]) for b in batch]),
        "lidar_aug_matrix": torch.stack([torch.as_tensor(b["lidar_aug_matrix"]) for b in batch]),
        "points": [torch.as_tensor(b["points"]) for b in batch],
        "gt_boxes": [torch.as_tensor(b["gt_boxes"], dtype=torch.float32) for b in batch],
        "gt_labels": [torch.as_tensor(b["gt_labels"]) for b in batch],
        "tokens": [b["token"] for b in batch],
    }
    return out


class BEVFusionRobust(nn.Module):
    def __init__(self, cam_dropout=0.0):
        super().__init__()
        self.cam_dropout = cam_dropout
        # camera stream
        self.img_backbone = SwinTransformerT(out_indices=(1, 2, 3), pretrained="ckpt/swint-nuimages-pretrained.pth")
        self.img_neck = GeneralizedLSSFPN([192, 384, 768], 256, num_outs=3)
        self.vtransform = DepthLSSTransform(in_channels=256, out_channels=80, image_size=(256, 704),
                                            feature_size=(32, 88), xbound=[-54.0, 54.0, 0.3],
                                            ybound=[-54.0, 54.0, 0.3], zbound=[-10.0, 10.0, 20.0],
                                            dbound=[1.0, 60.0, 0.5], downsample=2)
        # lidar stream
        self.voxelize = HardVoxelize(voxel_size=[0.075, 0.075, 0.2], point_cloud_range=[-54, -54, -5, 54, 54, 3],
                                     max_num_points=10, max_voxels=(120000, 160000))
        self.pts_encoder = SparseEncoder(in_channels=5, sparse_shape=[1440, 1440, 41], output_channels=128)
        # fusion + decoder
        self.fuser = nn.Sequential(nn.Conv2d(80 + 256, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256),
                                   nn.ReLU(True))
        self.bev_backbone = SECONDBackbone(in_channels=256, out_channels=[128, 256], layer_nums=[5, 5],
                                           layer_strides=[1, 2])
        self.bev_neck = SECONDFPN(in_channels=[128, 256], out_channels=[256, 256], upsample_strides=[1, 2])
        self.head = TransFusionHead(in_channels=512, num_proposals=200, num_classes=len(CLASSES),
                                    auxiliary=True, nms_kernel_size=3)

    def camera_bev(self, b):
        B, N = b["img"].shape[:2]
        feats = self.img_neck(self.img_backbone(b["img"].flatten(0, 1)))[0]
        feats = feats.view(B, N, *feats.shape[1:])
        return self.vtransform(feats, b["points"], b["camera2lidar"], b["camera_intrinsics"],
                               b["img_aug_matrix"], b["lidar_aug_matrix"])

    def lidar_bev(self, b):
        voxels, coords, num_points = self.voxelize(b["points"])
        return self.pts_encoder(voxels, coords, len(b["points"]), num_points)  # B, 256, 180, 180

    def forward(self, b):
        lidar = self.lidar_bev(b)
        if self.training and torch.rand(()) < self.cam_dropout:
            cam = lidar.new_zeros(lidar.shape[0], 80, *lidar.shape[2:])
        else:
            cam = self.camera_bev(b)
        x = self.fuser(torch.cat([cam, lidar], 1))
        return self.head(self.bev_neck(self.bev_backbone(x)))


def move(b, device):
    out = dict(b)
    for k, v in b.items():
        if torch.is_tensor(v):
            out[k] = v.to(device, non_blocking=True)
        elif isinstance(v, list) and v and torch.is_tensor(v[0]):
            out[k] = [t.to(device, non_blocking=True) for t in v]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="data/nuscenes")
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--load-lidar", default=None)
    ap.add_argument("--cam-dropout", type=float, default=0.25)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--samples-per-gpu", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-4)  # total batch 32
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
    torch.manual_seed(0)

    train_ds = NuScenesFusion(args.data_root, "train", train=True)
    val_ds = NuScenesFusion(args.data_root, "val", train=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.samples_per_gpu, sampler=sampler, num_workers=6, collate_fn=fusion_collate,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, 1, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=4,
                        collate_fn=fusion_collate)

    model = BEVFusionRobust(cam_dropout=args.cam_dropout)
    if args.load_lidar:
        sd = torch.load(args.load_lidar, map_location="cpu")["state_dict"]
        sd = {k: v for k, v in sd.items() if k.startswith(("pts_encoder.", "bev_backbone.", "bev_neck.", "head."))}
        res = model.load_state_dict(sd, strict=False)
        log.info("lidar weights loaded, %d keys missing (camera stream + fuser)", len(res.missing_keys))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.4,
                                                div_factor=10, final_div_factor=1e4)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, b in enumerate(train_dl):
            b = move(b, device)
            preds = model(b)
            losses = model.module.head.loss(b["gt_boxes"], b["gt_labels"], preds)
            loss = sum(v for k, v in losses.items() if "loss" in k)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 35)
            opt.step()
            sched.step()
            if rank == 0 and it % 50 == 0:
                log.info("epoch %d [%d/%d] loss %.4f heatmap %.4f bbox %.4f lr %.2e %.2fs/it", epoch, it, len(train_dl),
                         loss.item(), losses["loss_heatmap"].item(), losses["layer_-1_loss_bbox"].item(),
                         sched.get_last_lr()[0], (time.time() - t0) / (it + 1))
        if rank == 0:
            torch.save({"state_dict": model.module.state_dict(), "epoch": epoch},
                       os.path.join(args.work_dir, f"epoch_{epoch + 1}.pth"))

        model.eval()
        dets = {}
        with torch.no_grad():
            for b in val_dl:
                b = move(b, device)
                for tok, d in zip(b["tokens"], model.module.head.get_bboxes(model(b))):
                    dets[tok] = {k: v.cpu() for k, v in d.items()}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, dets)
        if rank == 0:
            merged = {k: v for g in gathered for k, v in g.items()}
            m = nuscenes_evaluate(merged, CLASSES, args.data_root, os.path.join(args.work_dir, f"eval_{epoch + 1}"))
            log.info("epoch %d: mAP %.4f NDS %.4f", epoch + 1, m["mAP"], m["NDS"])
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
