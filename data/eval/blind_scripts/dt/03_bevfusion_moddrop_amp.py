"""BEVFusion-style camera + lidar detector, nuScenes.

Stage 2 of our recipe: the lidar branch is initialised from the lidar-only
TransFusion-L / CenterPoint checkpoint and the whole model is trained with
modality dropout (randomly drop the camera BEV for a batch) so it degrades
gracefully when cameras are missing on the car.

    torchrun --nproc_per_node=8 train_bevfusion.py \
        --config configs/bevfusion_cam_lidar.yaml --lidar-ckpt ckpt/cp_voxel_0075.pth
"""
import argparse
import os
import pickle
import random
import time

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

from av3d.models.lidar import SparseVoxelEncoder
from av3d.models.view_transform import LSSTransform
from av3d.models.heads import CenterHead
from av3d.eval import nuscenes_evaluate
from av3d.utils import get_logger

CAMS = ["CAM_FRONT", "CAM_FRONT_RIGHT", "CAM_FRONT_LEFT", "CAM_BACK", "CAM_BACK_LEFT", "CAM_BACK_RIGHT"]
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


class NuScenesMultiModal(Dataset):
    def __init__(self, cfg, split):
        self.root = cfg["data_root"]
        with open(os.path.join(self.root, f"nuscenes_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)["infos"]
        self.img_size = tuple(cfg["img_size"])  # (H, W)
        self.sweeps = cfg["sweeps"]
        self.classes = cfg["classes"]

    def __len__(self):
        return len(self.infos)

    def load_points(self, info):
        pts = np.fromfile(os.path.join(self.root, info["lidar_path"]), np.float32).reshape(-1, 5)
        pts[:, 4] = 0.0
        out = [pts]
        for sw in info["sweeps"][: self.sweeps - 1]:
            p = np.fromfile(os.path.join(self.root, sw["data_path"]), np.float32).reshape(-1, 5)
            p[:, :3] = p[:, :3] @ sw["sensor2lidar_rotation"].T + sw["sensor2lidar_translation"]
            p[:, 4] = (info["timestamp"] - sw["timestamp"]) / 1e6
            out.append(p)
        return np.concatenate(out)

    def __getitem__(self, idx):
        info = self.infos[idx]
        imgs, lidar2img = [], []
        H, W = self.img_size
        for cam in CAMS:
            c = info["cams"][cam]
            img = Image.open(os.path.join(self.root, c["data_path"])).convert("RGB")
            sx, sy = W / img.width, H / img.height
            img = img.resize((W, H), Image.BILINEAR)
            imgs.append((torchvision.transforms.functional.to_tensor(img) - MEAN) / STD)
            K = np.eye(4, dtype=np.float32)
            K[:3, :3] = c["cam_intrinsic"]
            K[0] *= sx
            K[1] *= sy
            l2c = np.linalg.inv(c["sensor2lidar"]).astype(np.float32)
            lidar2img.append(K @ l2c)
        keep = np.isin(info["gt_names"], self.classes)
        return {
            "imgs": torch.stack(imgs),
            "lidar2img": torch.from_numpy(np.stack(lidar2img)),
            "points": torch.from_numpy(self.load_points(info)),
            "gt_boxes": torch.from_numpy(info["gt_boxes"][keep].astype(np.float32)),
            "gt_labels": torch.tensor([self.classes.index(n) for n in info["gt_names"][keep]], dtype=torch.long),
            "token": info["token"],
        }


def collate_mm(samples):
    return {
        "imgs": torch.stack([s["imgs"] for s in samples]),
        "lidar2img": torch.stack([s["lidar2img"] for s in samples]),
        "points": torch.cat([F.pad(s["points"], (1, 0), value=i) for i, s in enumerate(samples)]),
        "gt_boxes": [s["gt_boxes"] for s in samples],
        "gt_labels": [s["gt_labels"] for s in samples],
        "tokens": [s["token"] for s in samples],
    }


class CameraEncoder(nn.Module):
    def __init__(self, out_ch=256):
        super().__init__()
        r50 = torchvision.models.resnet50(weights="IMAGENET1K_V2", norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.stem = nn.Sequential(r50.conv1, r50.bn1, r50.relu, r50.maxpool, r50.layer1)
        self.layer2, self.layer3, self.layer4 = r50.layer2, r50.layer3, r50.layer4
        self.lat3 = nn.Conv2d(1024, out_ch, 1)
        self.lat4 = nn.Conv2d(2048, out_ch, 1)
        self.out = nn.Conv2d(out_ch, out_ch, 3, padding=1)

    def forward(self, x):
        c3 = self.layer3(self.layer2(self.stem(x)))
        c4 = self.layer4(c3)
        p = self.lat3(c3) + F.interpolate(self.lat4(c4), size=c3.shape[-2:], mode="bilinear", align_corners=False)
        return self.out(p)  # stride 16


class BEVFusion(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cam_encoder = CameraEncoder(256)
        self.view_transform = LSSTransform(in_ch=256, out_ch=80, image_size=cfg["img_size"], feature_stride=16,
                                           xbound=[-54.0, 54.0, 0.3], ybound=[-54.0, 54.0, 0.3],
                                           zbound=[-10.0, 10.0, 20.0], dbound=[1.0, 60.0, 0.5], downsample=2)
        self.lidar_encoder = SparseVoxelEncoder(voxel_size=[0.075, 0.075, 0.2],
                                                pc_range=[-54.0, -54.0, -5.0, 54.0, 54.0, 3.0], out_ch=256)
        self.fuser = nn.Sequential(nn.Conv2d(80 + 256, 256, 3, padding=1, bias=False),
                                   nn.BatchNorm2d(256), nn.ReLU(True))
        self.decoder = nn.Sequential(*[m for _ in range(4) for m in
                                       (nn.Conv2d(256, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True))])
        self.head = CenterHead(256, tasks=cfg["tasks"], out_size_factor=8)
        self.cam_drop_prob = cfg.get("cam_drop_prob", 0.0)

    def forward(self, imgs, lidar2img, points, batch_size):
        lidar_bev = self.lidar_encoder(points, batch_size)
        if self.training and random.random() < self.cam_drop_prob:
            cam_bev = lidar_bev.new_zeros(batch_size, 80, *lidar_bev.shape[-2:])
        else:
            B, N = imgs.shape[:2]
            feats = self.cam_encoder(imgs.flatten(0, 1))
            feats = feats.view(B, N, *feats.shape[1:])
            cam_bev = self.view_transform(feats, lidar2img)
        x = self.fuser(torch.cat([cam_bev, lidar_bev], 1))
        return self.head(self.decoder(x))


def load_lidar_branch(model, path, logger):
    sd = torch.load(path, map_location="cpu")
    sd = sd.get("state_dict", sd)
    sd = {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}
    enc = {k[len("lidar_encoder."):]: v for k, v in sd.items() if k.startswith("lidar_encoder.")}
    missing, unexpected = model.lidar_encoder.load_state_dict(enc, strict=False)
    logger.info("lidar branch init from %s: %d missing, %d unexpected", path, len(missing), len(unexpected))


@torch.no_grad()
def evaluate(model, loader, cfg, logger):
    model.eval()
    preds = {}
    for b in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(b["imgs"].cuda(non_blocking=True), b["lidar2img"].cuda(non_blocking=True),
                        b["points"].cuda(non_blocking=True), len(b["tokens"]))
        for tok, det in zip(b["tokens"], model.module.head.decode(out, score_thr=0.05)):
            preds[tok] = {k: v.float().cpu() for k, v in det.items()}
    all_preds = [None] * dist.get_world_size()
    dist.all_gather_object(all_preds, preds)
    if dist.get_rank() == 0:
        merged = {}
        for p in all_preds:
            merged.update(p)
        m = nuscenes_evaluate(merged, cfg["classes"], cfg["data_root"], os.path.join(cfg["work_dir"], "eval"))
        logger.info("val mAP %.4f NDS %.4f (%d samples)", m["mAP"], m["NDS"], len(merged))
    model.train()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--lidar-ckpt", default=None)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        os.makedirs(cfg["work_dir"], exist_ok=True)
    dist.barrier()
    logger = get_logger("bevfusion", os.path.join(cfg["work_dir"], "train.log") if rank == 0 else None)
    torch.manual_seed(cfg.get("seed", 0))
    random.seed(cfg.get("seed", 0) + rank)  # modality dropout differs per rank on purpose

    train_set, val_set = NuScenesMultiModal(cfg, "train"), NuScenesMultiModal(cfg, "val")
    sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.get("seed", 0))
    train_loader = DataLoader(train_set, batch_size=cfg["samples_per_gpu"], sampler=sampler, num_workers=8,
                              collate_fn=collate_mm, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=4, collate_fn=collate_mm)

    model = BEVFusion(cfg)
    if args.lidar_ckpt:
        load_lidar_branch(model, args.lidar_ckpt, logger)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    # camera branch is skipped on dropped batches
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    lr = cfg["base_lr"] * cfg["samples_per_gpu"] * world / cfg["base_batch"]
    opt = torch.optim.AdamW([
        {"params": model.module.cam_encoder.parameters(), "lr": lr * 0.1},
        {"params": [p for n, p in model.module.named_parameters() if not n.startswith("cam_encoder.")]},
    ], lr=lr, weight_decay=0.01)
    iters = cfg["epochs"] * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[lr * 0.1, lr], total_steps=iters, pct_start=0.4)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch = ck["epoch"] + 1

    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, b in enumerate(train_loader):
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(b["imgs"].cuda(non_blocking=True), b["lidar2img"].cuda(non_blocking=True),
                            b["points"].cuda(non_blocking=True), len(b["tokens"]))
                losses = model.module.head.loss(out, [x.cuda() for x in b["gt_boxes"]],
                                                [x.cuda() for x in b["gt_labels"]])
                loss = sum(losses.values())
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 35.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and it % 50 == 0:
                logger.info("ep %d it %d/%d loss %.3f %s %.2fs/it", epoch, it, len(train_loader), loss.item(),
                            {k: round(v.item(), 3) for k, v in losses.items()}, (time.time() - t0) / (it + 1))
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch},
                       os.path.join(cfg["work_dir"], f"epoch_{epoch + 1}.pth"))
        dist.barrier()
        if (epoch + 1) % cfg.get("eval_interval", 2) == 0:
            evaluate(model, val_loader, cfg, logger)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
