"""Top-down 2D + root-relative 3D human pose, trained on a COCO / Human3.6M mixture.

2D heatmaps come from every sample, depth only from Human3.6M crops (COCO has no 3D).
Launch: torchrun --nproc_per_node=8 train_pose_mixed.py --cfg configs/res50_256x192_mix.yaml
"""
import argparse
import json
import os
import pickle

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

NUM_JOINTS = 17
FLIP_PAIRS = [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12), (13, 14), (15, 16)]
IMG_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
IMG_STD = np.array([0.229, 0.224, 0.225], np.float32)


def affine_from_box(center, scale, rot, out_size):
    w, h = out_size
    src_w = scale[0]
    rad = np.deg2rad(rot)
    src_dir = np.array([0, src_w * -0.5]) @ np.array([[np.cos(rad), np.sin(rad)], [-np.sin(rad), np.cos(rad)]])
    src = np.stack([center, center + src_dir, center + np.array([-src_dir[1], src_dir[0]])]).astype(np.float32)
    dst = np.array([[w * 0.5, h * 0.5], [w * 0.5, h * 0.5 - w * 0.5], [w * 0.5 + w * 0.5, h * 0.5]], np.float32)
    return cv2.getAffineTransform(src, dst)


class PoseCrops(Dataset):
    """Samples from a pkl cache: image path, bbox, 2D joints (17x3), optional root-relative 3D joints (17x3, mm)."""

    def __init__(self, ann_file, img_root, train, input_size=(192, 256), sigma=2):
        with open(ann_file, "rb") as f:
            self.db = pickle.load(f)
        self.img_root, self.train = img_root, train
        self.input_size, self.hm_size, self.sigma = input_size, (input_size[0] // 4, input_size[1] // 4), sigma

    def __len__(self):
        return len(self.db)

    def __getitem__(self, idx):
        rec = self.db[idx]
        img = cv2.imread(os.path.join(self.img_root, rec["image"]), cv2.IMREAD_COLOR)[..., ::-1]
        x, y, w, h = rec["bbox"]
        center = np.array([x + w / 2, y + h / 2], np.float32)
        aspect = self.input_size[0] / self.input_size[1]
        w, h = (h * aspect, h) if w < h * aspect else (w, w / aspect)
        scale = np.array([w, h], np.float32) * 1.25
        joints = rec["joints_2d"].copy()
        j3d = rec.get("joints_3d")
        has3d = j3d is not None
        j3d = j3d.copy() / 1000.0 if has3d else np.zeros((NUM_JOINTS, 3), np.float32)
        rot = 0.0
        if self.train:
            scale = scale * np.clip(np.random.randn() * 0.25 + 1, 0.75, 1.25)
            rot = np.clip(np.random.randn() * 30, -60, 60) if np.random.rand() <= 0.6 else 0.0
            if np.random.rand() <= 0.5:
                img = img[:, ::-1]
                joints[:, 0] = img.shape[1] - joints[:, 0] - 1
                center[0] = img.shape[1] - center[0] - 1
                j3d[:, 0] *= -1
                for a, b in FLIP_PAIRS:
                    joints[[a, b]] = joints[[b, a]]
                    j3d[[a, b]] = j3d[[b, a]]
        trans = affine_from_box(center, scale, rot, self.input_size)
        crop = cv2.warpAffine(np.ascontiguousarray(img), trans, self.input_size, flags=cv2.INTER_LINEAR)
        crop = (crop.astype(np.float32) / 255.0 - IMG_MEAN) / IMG_STD
        pts = np.concatenate([joints[:, :2], np.ones((NUM_JOINTS, 1))], 1) @ trans.T
        target, weight = self.make_heatmaps(pts, joints[:, 2])
        return {"img": torch.from_numpy(crop.transpose(2, 0, 1).copy()), "heatmap": torch.from_numpy(target),
                "weight": torch.from_numpy(weight), "joints_img": torch.from_numpy(pts.astype(np.float32)),
                "vis": torch.from_numpy((joints[:, 2] > 0).astype(np.float32)),
                "joints_3d": torch.from_numpy(j3d.astype(np.float32)), "has3d": torch.tensor(float(has3d))}

    def make_heatmaps(self, pts, vis):
        W, H = self.hm_size
        stride = self.input_size[0] / W
        target = np.zeros((NUM_JOINTS, H, W), np.float32)
        weight = (vis > 0).astype(np.float32)
        xs, ys = np.arange(W)[None], np.arange(H)[:, None]
        for j in range(NUM_JOINTS):
            mx, my = pts[j] / stride
            if weight[j] == 0 or not (0 <= mx < W and 0 <= my < H):
                weight[j] = 0
                continue
            target[j] = np.exp(-((xs - mx) ** 2 + (ys - my) ** 2) / (2 * self.sigma ** 2))
        return target, weight


class PoseNet2D3D(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        layers, cin = [], 2048
        for _ in range(3):
            layers += [nn.ConvTranspose2d(cin, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True)]
            cin = 256
        self.deconv = nn.Sequential(*layers)
        self.hm_head = nn.Conv2d(256, NUM_JOINTS, 1)
        self.depth_head = nn.Sequential(nn.Conv2d(256, 256, 3, 1, 1, bias=False), nn.BatchNorm2d(256),
                                        nn.ReLU(True), nn.Conv2d(256, NUM_JOINTS, 1))

    def forward(self, x):
        f = self.deconv(self.backbone(x))
        hm = self.hm_head(f)
        prob = F.softmax(hm.flatten(2), -1).view_as(hm)
        depth = (prob * self.depth_head(f)).sum((2, 3))  # heatmap-weighted depth per joint
        return hm, depth


def heatmap_argmax(hm):
    B, J, H, W = hm.shape
    val, idx = hm.flatten(2).max(-1)
    return torch.stack([idx % W, idx // W], -1).float(), val


def pose_loss(hm_pred, depth_pred, batch):
    w = batch["weight"][..., None, None]
    loss_2d = 0.5 * ((hm_pred - batch["heatmap"]) ** 2 * w).mean() * NUM_JOINTS
    loss = loss_2d
    has3d = batch["has3d"] > 0
    loss_3d = torch.zeros((), device=hm_pred.device)
    if has3d.any():
        root_rel = batch["joints_3d"][..., 2] - batch["joints_3d"][:, :1, 2]
        loss_3d = F.l1_loss(depth_pred[has3d] - depth_pred[has3d][:, :1], root_rel[has3d])
        loss = loss + 0.1 * loss_3d
    return loss, loss_2d.detach(), loss_3d.detach()


@torch.no_grad()
def validate(model, loader, device):
    """PCK@0.2 of the crop width on 2D and mean absolute relative-depth error (mm) on 3D samples."""
    model.eval()
    acc = torch.zeros(4, device=device, dtype=torch.float64)  # hits, visible, depth err sum, n3d joints
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        hm, depth = model(batch["img"])
        flipped, _ = model(torch.flip(batch["img"], [3]))
        flipped = torch.flip(flipped, [3])
        for a, b in FLIP_PAIRS:
            flipped[:, [a, b]] = flipped[:, [b, a]]
        hm = 0.5 * (hm + flipped)
        pred, _ = heatmap_argmax(hm)
        stride = batch["img"].shape[-1] / hm.shape[-1]
        err = (pred * stride - batch["joints_img"]).norm(dim=-1)
        vis = batch["vis"] > 0
        acc[0] += (err[vis] < 0.2 * batch["img"].shape[-1]).sum()
        acc[1] += vis.sum()
        h3 = batch["has3d"] > 0
        if h3.any():
            rel = depth[h3] - depth[h3][:, :1]
            gt = batch["joints_3d"][h3][..., 2] - batch["joints_3d"][h3][:, :1, 2]
            acc[2] += (rel - gt).abs().sum() * 1000.0
            acc[3] += gt.numel()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1].clamp(min=1)).item(), (acc[2] / acc[3].clamp(min=1)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])
    np.random.seed(cfg["seed"] + rank)

    train_set = ConcatDataset([PoseCrops(cfg["coco_train"], cfg["coco_img"], True),
                               PoseCrops(cfg["h36m_train"], cfg["h36m_img"], True)])
    val_set = ConcatDataset([PoseCrops(cfg["coco_val"], cfg["coco_img"], False),
                             PoseCrops(cfg["h36m_val"], cfg["h36m_img"], False)])
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_per_gpu"], sampler=sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=cfg["batch_per_gpu"], num_workers=cfg["workers"])

    model = nn.SyncBatchNorm.convert_sync_batchnorm(PoseNet2D3D()).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, cfg["lr_steps"], 0.1)

    start_epoch, best = 0, 0.0
    out_dir = cfg["output_dir"]
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ck["state_dict"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_epoch, best = ck["epoch"] + 1, ck["best_pck"]

    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        for i, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            hm, depth = model(batch["img"])
            loss, l2d, l3d = pose_loss(hm, depth, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if rank == 0 and i % cfg["print_freq"] == 0:
                print(f"Epoch[{epoch}][{i}/{len(train_loader)}] loss {loss.item():.5f} "
                      f"2d {l2d.item():.5f} 3d {l3d.item():.4f}", flush=True)
        scheduler.step()

        pck, depth_err = validate(model.module, val_loader, device)
        if rank == 0:
            print(f"Epoch {epoch}: PCK {pck:.4f} rel-depth err {depth_err:.1f} mm", flush=True)
            best = max(best, pck)
            os.makedirs(out_dir, exist_ok=True)
            torch.save({"state_dict": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "best_pck": best},
                       os.path.join(out_dir, "checkpoint.pth"))
            if pck >= best:
                torch.save(model.module.state_dict(), os.path.join(out_dir, "model_best.pth"))
            with open(os.path.join(out_dir, "val_log.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "pck": pck, "depth_err_mm": depth_err}) + "\n")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
