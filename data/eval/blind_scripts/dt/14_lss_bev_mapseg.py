"""Lift-Splat-Shoot BEV segmentation (vehicle / drivable area / lane divider) on nuScenes.

  torchrun --nproc_per_node=8 train_lss_seg.py --dataroot /data/nuscenes --logdir runs/lss_map_v3
"""
import argparse
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from av3d.ops import bev_pool

XBOUND = [-50.0, 50.0, 0.5]
YBOUND = [-50.0, 50.0, 0.5]
ZBOUND = [-10.0, 10.0, 20.0]
DBOUND = [4.0, 45.0, 1.0]
FINAL_DIM = (128, 352)
LAYERS = ["vehicle", "drivable_area", "divider"]
CAMS = ["CAM_FRONT_LEFT", "CAM_FRONT", "CAM_FRONT_RIGHT", "CAM_BACK_LEFT", "CAM_BACK", "CAM_BACK_RIGHT"]


def gen_dx_bx(xb, yb, zb):
    dx = torch.tensor([r[2] for r in (xb, yb, zb)])
    bx = torch.tensor([r[0] + r[2] / 2.0 for r in (xb, yb, zb)])
    nx = torch.tensor([int((r[1] - r[0]) / r[2]) for r in (xb, yb, zb)])
    return dx, bx, nx


class MapSegData(Dataset):
    """Samples + rasterised BEV targets (produced offline by tools/rasterize_map.py)."""

    def __init__(self, dataroot, split, is_train):
        with open(os.path.join(dataroot, f"lss_infos_{split}.pkl"), "rb") as f:
            self.infos = pickle.load(f)
        self.dataroot, self.is_train = dataroot, is_train
        self.norm = torchvision.transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])

    def __len__(self):
        return len(self.infos)

    def sample_augmentation(self, W, H):
        fH, fW = FINAL_DIM
        if self.is_train:
            resize = np.random.uniform(0.193, 0.225)
            rot = np.random.uniform(-5.4, 5.4)
            flip = np.random.rand() < 0.5
        else:
            resize, rot, flip = max(fH / H, fW / W), 0.0, False
        rW, rH = int(W * resize), int(H * resize)
        crop_h = int((1 - np.random.uniform(0.0, 0.22) if self.is_train else 1.0) * rH) - fH
        crop_w = int(np.random.uniform(0, max(0, rW - fW))) if self.is_train else int(max(0, rW - fW) / 2)
        return resize, (crop_w, crop_h, crop_w + fW, crop_h + fH), flip, rot

    def __getitem__(self, idx):
        info = self.infos[idx]
        imgs, rots, trans, intrins, post_rots, post_trans = [], [], [], [], [], []
        for cam in CAMS:
            c = info["cams"][cam]
            img = Image.open(os.path.join(self.dataroot, c["filename"]))
            resize, crop, flip, rot = self.sample_augmentation(img.width, img.height)
            img = img.resize((int(img.width * resize), int(img.height * resize))).crop(crop)
            post_rot, post_tran = torch.eye(2) * resize, -torch.tensor(crop[:2], dtype=torch.float32)
            if flip:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
                A = torch.tensor([[-1.0, 0.0], [0.0, 1.0]])
                post_rot, post_tran = A @ post_rot, A @ post_tran + torch.tensor([crop[2] - crop[0], 0.0])
            img = img.rotate(rot)
            th = np.deg2rad(rot)
            A = torch.tensor([[np.cos(th), np.sin(th)], [-np.sin(th), np.cos(th)]], dtype=torch.float32)
            b = torch.tensor([crop[2] - crop[0], crop[3] - crop[1]], dtype=torch.float32) / 2
            post_rot, post_tran = A @ post_rot, A @ (post_tran - b) + b
            P, T = torch.eye(3), torch.zeros(3)
            P[:2, :2], T[:2] = post_rot, post_tran
            imgs.append(self.norm(torchvision.transforms.functional.to_tensor(img)))
            rots.append(torch.tensor(c["rot"], dtype=torch.float32))
            trans.append(torch.tensor(c["trans"], dtype=torch.float32))
            intrins.append(torch.tensor(c["intrinsic"], dtype=torch.float32))
            post_rots.append(P)
            post_trans.append(T)
        target = np.load(os.path.join(self.dataroot, info["bev_target"]))["masks"].astype(np.float32)  # (3, 200, 200)
        return (torch.stack(imgs), torch.stack(rots), torch.stack(trans), torch.stack(intrins),
                torch.stack(post_rots), torch.stack(post_trans), torch.from_numpy(target))


class CamEncode(nn.Module):
    def __init__(self, D, C):
        super().__init__()
        self.D, self.C = D, C
        eff = torchvision.models.efficientnet_b0(weights="IMAGENET1K_V1")
        self.trunk = eff.features[:6]  # stride 16, 112 ch
        self.up = nn.Sequential(nn.Conv2d(112 + 40, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True))
        self.depthnet = nn.Conv2d(256, D + C, 1)

    def forward(self, x):
        x8 = self.trunk[:4](x)
        x16 = self.trunk[4:](x8)
        x = self.up(torch.cat([F.interpolate(x16, size=x8.shape[-2:], mode="bilinear", align_corners=True), x8], 1))
        x = self.depthnet(x)
        depth = x[:, : self.D].softmax(1)
        return depth.unsqueeze(1) * x[:, self.D:].unsqueeze(2)  # B*N, C, D, h, w


class LiftSplatShoot(nn.Module):
    def __init__(self, outC=len(LAYERS), C=64):
        super().__init__()
        dx, bx, nx = gen_dx_bx(XBOUND, YBOUND, ZBOUND)
        self.register_buffer("dx", dx, persistent=False)
        self.register_buffer("bx", bx, persistent=False)
        self.nx = nx.tolist()
        self.downsample = 8
        self.frustum = nn.Parameter(self.create_frustum(), requires_grad=False)
        self.D = self.frustum.shape[0]
        self.C = C
        self.camencode = CamEncode(self.D, C)
        trunk = torchvision.models.resnet18(weights=None, zero_init_residual=True)
        self.bev_enc = nn.Sequential(nn.Conv2d(C, 64, 7, 2, 3, bias=False), trunk.bn1, trunk.relu,
                                     trunk.layer1, trunk.layer2, trunk.layer3)
        self.bev_up = nn.Sequential(nn.Upsample(scale_factor=4, mode="bilinear", align_corners=True),
                                    nn.Conv2d(256, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True),
                                    nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True),
                                    nn.Conv2d(256, 128, 3, padding=1, bias=False), nn.BatchNorm2d(128), nn.ReLU(True),
                                    nn.Conv2d(128, outC, 1))

    def create_frustum(self):
        fH, fW = FINAL_DIM[0] // 8, FINAL_DIM[1] // 8
        ds = torch.arange(*DBOUND).view(-1, 1, 1).expand(-1, fH, fW)
        D = ds.shape[0]
        xs = torch.linspace(0, FINAL_DIM[1] - 1, fW).view(1, 1, fW).expand(D, fH, fW)
        ys = torch.linspace(0, FINAL_DIM[0] - 1, fH).view(1, fH, 1).expand(D, fH, fW)
        return torch.stack((xs, ys, ds), -1)

    def get_geometry(self, rots, trans, intrins, post_rots, post_trans):
        B, N = trans.shape[:2]
        pts = self.frustum - post_trans.view(B, N, 1, 1, 1, 3)
        pts = torch.inverse(post_rots).view(B, N, 1, 1, 1, 3, 3).matmul(pts.unsqueeze(-1))
        pts = torch.cat((pts[:, :, :, :, :, :2] * pts[:, :, :, :, :, 2:3], pts[:, :, :, :, :, 2:3]), 5)
        combine = rots.matmul(torch.inverse(intrins))
        pts = combine.view(B, N, 1, 1, 1, 3, 3).matmul(pts).squeeze(-1)
        return pts + trans.view(B, N, 1, 1, 1, 3)

    def forward(self, x, rots, trans, intrins, post_rots, post_trans):
        B, N = x.shape[:2]
        geom = self.get_geometry(rots, trans, intrins, post_rots, post_trans)
        feats = self.camencode(x.flatten(0, 1))
        feats = feats.view(B, N, self.C, self.D, *feats.shape[-2:]).permute(0, 1, 3, 4, 5, 2)
        bev = bev_pool(feats, geom, self.dx, self.bx, self.nx)  # B, C, 200, 200
        return self.bev_up(self.bev_enc(bev))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    inter = torch.zeros(len(LAYERS), device=device)
    union = torch.zeros(len(LAYERS), device=device)
    for batch in loader:
        *inputs, target = [t.to(device, non_blocking=True) for t in batch]
        pred = model(*inputs).sigmoid() > 0.4
        tgt = target > 0.5
        inter += (pred & tgt).flatten(2).sum((0, 2)).float()
        union += (pred | tgt).flatten(2).sum((0, 2)).float()
    dist.all_reduce(inter)
    dist.all_reduce(union)
    model.train()
    return (inter / union.clamp(min=1)).tolist()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dataroot", default="/data/nuscenes")
    p.add_argument("--logdir", default="runs/lss")
    p.add_argument("--nepochs", type=int, default=30)
    p.add_argument("--bsz", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--pos-weight", type=float, default=2.13)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    writer = SummaryWriter(args.logdir) if rank == 0 else None

    train_ds, val_ds = MapSegData(args.dataroot, "train", True), MapSegData(args.dataroot, "val", False)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.bsz, sampler=train_sampler, num_workers=10,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    # strided shard without padding so every val sample is counted exactly once in the IoU sums
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=args.bsz,
                            num_workers=10, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(LiftSplatShoot()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world / 8, weight_decay=1e-7)
    loss_fn = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([args.pos_weight], device=device))

    step, best = 0, 0.0
    for epoch in range(args.nepochs):
        model.train()
        t0 = time.time()
        for batch in train_loader:
            *inputs, target = [t.to(device, non_blocking=True) for t in batch]
            preds = model(*inputs)
            loss = loss_fn(preds, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            step += 1
            if writer is not None and step % 10 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/step_time", (time.time() - t0) / 10, step)
                t0 = time.time()

        ious = evaluate(model, val_loader, device)
        if rank == 0:
            for name, v in zip(LAYERS, ious):
                writer.add_scalar(f"val/iou_{name}", v, epoch)
            print(f"epoch {epoch}: " + ", ".join(f"{n}={v:.4f}" for n, v in zip(LAYERS, ious)), flush=True)
            torch.save(model.module.state_dict(), os.path.join(args.logdir, f"model_{epoch:03d}.pt"))
            if np.mean(ious) > best:
                best = float(np.mean(ious))
                torch.save(model.module.state_dict(), os.path.join(args.logdir, "best.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
