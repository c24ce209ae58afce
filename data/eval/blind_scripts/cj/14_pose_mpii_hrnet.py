"""HRNet-W48 256x256 on MPII, PCKh@0.5 on the validation split.

Annotation files are the json versions shipped with deep-high-resolution-net
(annot/train.json, annot/valid.json, annot/gt_valid.mat).

torchrun --nproc_per_node=4 14_pose_mpii_hrnet.py --root /data/mpii --output-dir output/mpii_w48
"""
import argparse
import json
import os
import shutil

import cv2
import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from scipy.io import loadmat
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

MPII_FLIP = [5, 4, 3, 2, 1, 0, 6, 7, 8, 9, 15, 14, 13, 12, 11, 10]
SIZE, HM = 256, 64


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/mpii")
    ap.add_argument("--output-dir", default="output/mpii_w48")
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3, help="Adam lr for a global batch of 128")
    ap.add_argument("--epochs", type=int, default=210)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


class MPII(Dataset):
    def __init__(self, root, split, train):
        with open(os.path.join(root, "annot", f"{split}.json")) as f:
            self.anns = json.load(f)
        self.img_dir, self.train = os.path.join(root, "images"), train
        self.head_sizes = None
        if split == "valid":
            gt = loadmat(os.path.join(root, "annot", "gt_valid.mat"))
            boxes = gt["headboxes_src"]  # 2 x 2 x N
            self.head_sizes = np.linalg.norm(boxes[1, :, :] - boxes[0, :, :], axis=0) * 0.6

    def __len__(self):
        return len(self.anns)

    def __getitem__(self, i):
        a = self.anns[i]
        img = cv2.imread(os.path.join(self.img_dir, a["image"]))[:, :, ::-1]
        center = np.array(a["center"], np.float32)
        scale = float(a["scale"]) * 1.25 * 200.0
        center[1] += 15 * a["scale"]
        joints = np.array(a["joints"], np.float32)
        vis = np.array(a["joints_vis"], np.float32)
        rot = 0.0
        if self.train:
            scale *= np.clip(np.random.randn() * 0.25 + 1, 0.75, 1.25)
            rot = float(np.clip(np.random.randn() * 30, -60, 60)) if np.random.rand() < 0.6 else 0.0
            if np.random.rand() < 0.5:
                img = img[:, ::-1]
                center[0] = img.shape[1] - 1 - center[0]
                joints, vis = joints[MPII_FLIP], vis[MPII_FLIP]
                joints[:, 0] = img.shape[1] - 1 - joints[:, 0]
        M = cv2.getRotationMatrix2D((float(center[0]), float(center[1])), rot, SIZE / scale)
        M[:, 2] += SIZE / 2 - center
        patch = cv2.warpAffine(np.ascontiguousarray(img), M, (SIZE, SIZE))
        pts = np.c_[joints, np.ones(16)] @ M.T * (HM / SIZE)
        g = np.arange(HM, dtype=np.float32)
        target = np.zeros((16, HM, HM), np.float32)
        for j in range(16):
            if vis[j] > 0 and 0 <= pts[j, 0] < HM and 0 <= pts[j, 1] < HM:
                target[j] = np.exp(-((g[None] - pts[j, 0]) ** 2 + (g[:, None] - pts[j, 1]) ** 2) / 8.0)
            else:
                vis[j] = 0
        patch = ((patch / 255.0 - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]).astype(np.float32)
        head = self.head_sizes[i] if self.head_sizes is not None else 0.0
        meta = torch.tensor([center[0], center[1], scale, head], dtype=torch.float64)
        gt = torch.from_numpy(np.c_[joints, vis].astype(np.float32))
        return torch.from_numpy(patch.transpose(2, 0, 1).copy()), torch.from_numpy(target), torch.from_numpy(vis), meta, gt


class HRNetPose(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = timm.create_model("hrnet_w48", pretrained=True, features_only=True,
                                          feature_location="", out_indices=(1,))
        self.final_layer = nn.Conv2d(self.backbone.feature_info.channels()[0], 16, 1)

    def forward(self, x):
        return self.final_layer(self.backbone(x)[0])


def save_checkpoint(states, is_best, output_dir, filename="checkpoint.pth"):
    torch.save(states, os.path.join(output_dir, filename))
    if is_best:
        shutil.copyfile(os.path.join(output_dir, filename), os.path.join(output_dir, "model_best.pth"))


@torch.no_grad()
def validate(model, loader, device):
    """PCKh@0.5 over this rank's part of the validation set; counts are summed over ranks."""
    model.eval()
    hits = torch.zeros(16, device=device)
    counts = torch.zeros(16, device=device)
    for img, _, _, meta, gt in loader:
        img, meta, gt = img.to(device), meta.to(device), gt.to(device)
        hm = model(img) + model(img.flip(3)).flip(3)[:, MPII_FLIP]
        n = hm.size(0)
        idx = hm.view(n, 16, -1).argmax(2)
        xy = torch.stack([idx % HM, idx // HM], 2).double()
        xy = (xy / HM - 0.5) * meta[:, 2:3, None] + meta[:, None, :2]
        err = (xy - gt[..., :2].double()).norm(dim=2) / meta[:, 3:4]
        visible = gt[..., 2] > 0
        hits += ((err <= 0.5) & visible).sum(0).float()
        counts += visible.sum(0).float()
    dist.all_reduce(hits)
    dist.all_reduce(counts)
    pckh = hits / counts.clamp(min=1)
    keep = [j for j in range(16) if j not in (6, 7)]  # pelvis and thorax are excluded from the mean
    return (hits[keep].sum() / counts[keep].sum()).item(), pckh.cpu().numpy()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    os.makedirs(args.output_dir, exist_ok=True)

    train_set = MPII(args.root, "train", train=True)
    val_set = MPII(args.root, "valid", train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    val_part = Subset(val_set, list(range(rank, len(val_set), world)))
    val_loader = DataLoader(val_part, batch_size=64, shuffle=False, num_workers=8, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(HRNetPose()).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * args.batch_size * world / 128)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [170, 200], 0.1)

    begin_epoch, best_perf = 0, 0.0
    ckpt_file = os.path.join(args.output_dir, "checkpoint.pth")
    if args.resume and os.path.exists(ckpt_file):
        ckpt = torch.load(ckpt_file, map_location="cpu")
        model.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        begin_epoch, best_perf = ckpt["epoch"], ckpt["perf"]

    for epoch in range(begin_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for img, target, vis, _, _ in train_loader:
            img, target, vis = img.to(device, non_blocking=True), target.to(device), vis.to(device)
            out = model(img)
            loss = 0.5 * (((out - target) ** 2).mean(dim=(2, 3)) * vis).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(loss_sum)

        perf, per_joint = validate(model.module, val_loader, device)
        is_best = perf > best_perf
        best_perf = max(perf, best_perf)
        if rank == 0:
            print(f"Epoch {epoch}: loss {(loss_sum[0] / loss_sum[1]).item():.6f}  PCKh@0.5 {100 * perf:.2f}"
                  f"  (head {100 * per_joint[9]:.1f}, wrist {100 * (per_joint[10] + per_joint[15]) / 2:.1f})",
                  flush=True)
        save_checkpoint({"epoch": epoch + 1, "state_dict": model.module.state_dict(), "perf": best_perf,
                         "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                        is_best, args.output_dir)

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(args.output_dir, "final_state.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
