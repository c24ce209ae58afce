"""Fine-tune a COCO-pretrained top-down pose model on PoseTrack18 person boxes.

Validation reports PCK@0.2 (distance normalised by the box diagonal) on the val videos.

torchrun --nproc_per_node=4 17_pose_posetrack18_finetune.py --pt-root /data/PoseTrack18 --init work/coco_r50/best.pth
"""
import argparse
import glob
import json
import os
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

W, H = 192, 256
FLIP = [0, 2, 1, 4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 13, 16, 15]


def build_args():
    p = argparse.ArgumentParser()
    p.add_argument("--pt-root", default="/data/PoseTrack18")
    p.add_argument("--init", default="", help="COCO checkpoint to start from")
    p.add_argument("--out", default="work/posetrack18_r50")
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=20)
    return p.parse_args()


def load_posetrack(root, split):
    recs = []
    for jf in sorted(glob.glob(os.path.join(root, "annotations", split, "*.json"))):
        with open(jf) as f:
            d = json.load(f)
        images = {im["id"]: im for im in d["images"]}
        for a in d["annotations"]:
            kp = np.array(a.get("keypoints", []), np.float32).reshape(-1, 3)
            if len(kp) != 17 or (kp[:, 2] > 0).sum() < 3 or "bbox" not in a:
                continue
            recs.append({"file": images[a["image_id"]]["file_name"], "bbox": a["bbox"], "kpts": kp,
                         "track_id": a.get("track_id", -1)})
    return recs


class PTDataset(Dataset):
    def __init__(self, root, recs, train):
        self.root, self.recs, self.train = root, recs, train

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, i):
        r = self.recs[i]
        img = cv2.imread(os.path.join(self.root, r["file"]))[:, :, ::-1]
        x, y, w, h = r["bbox"]
        c = np.array([x + w / 2, y + h / 2])
        s = max(w, h * W / H) * 1.25
        kp = r["kpts"].copy()
        ang = 0.0
        if self.train:
            s *= np.random.uniform(0.8, 1.2)
            ang = np.random.uniform(-30, 30) if np.random.rand() < 0.5 else 0.0
            if np.random.rand() < 0.5:
                img = img[:, ::-1]
                c[0] = img.shape[1] - 1 - c[0]
                kp = kp[FLIP]
                kp[:, 0] = img.shape[1] - 1 - kp[:, 0]
        M = cv2.getRotationMatrix2D((float(c[0]), float(c[1])), ang, W / s)
        M[:, 2] += (W / 2 - c[0], H / 2 - c[1])
        crop = cv2.warpAffine(np.ascontiguousarray(img), M, (W, H))
        p = np.c_[kp[:, :2], np.ones(17)] @ M.T / 4
        gx, gy = np.meshgrid(np.arange(W // 4), np.arange(H // 4))
        heat = np.zeros((17, H // 4, W // 4), np.float32)
        vis = (kp[:, 2] > 0).astype(np.float32)
        for j in np.flatnonzero(vis):
            heat[j] = np.exp(-((gx - p[j, 0]) ** 2 + (gy - p[j, 1]) ** 2) / 8.0)
        crop = ((crop / 255.0 - (0.485, 0.456, 0.406)) / (0.229, 0.224, 0.225)).astype(np.float32)
        box = np.array([c[0], c[1], s, np.hypot(w, h)], np.float32)
        return (torch.from_numpy(crop.transpose(2, 0, 1).copy()), torch.from_numpy(heat), torch.from_numpy(vis),
                torch.from_numpy(box), torch.from_numpy(kp))


def make_model():
    r = torchvision.models.resnet50()
    layers = list(r.children())[:-2]
    ch = 2048
    for _ in range(3):
        layers += [nn.ConvTranspose2d(ch, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(inplace=True)]
        ch = 256
    layers.append(nn.Conv2d(256, 17, 1))
    return nn.Sequential(*layers)


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)

        train_recs = load_posetrack(args.pt_root, "train")
        val_recs = load_posetrack(args.pt_root, "val")
        self.train_set, self.val_set = PTDataset(args.pt_root, train_recs, True), PTDataset(args.pt_root, val_recs, False)
        self.train_sampler = DistributedSampler(self.train_set)
        self.train_loader = DataLoader(self.train_set, args.batch_size, sampler=self.train_sampler, num_workers=8,
                                       pin_memory=True, drop_last=True)
        # every rank scores a strided, non-overlapping part of the val boxes
        val_part = Subset(self.val_set, range(self.rank, len(self.val_set), self.world))
        self.val_loader = DataLoader(val_part, 96, shuffle=False, num_workers=8, pin_memory=True)

        net = make_model()
        if args.init:
            sd = torch.load(args.init, map_location="cpu")
            sd = {k.replace("module.", ""): v for k, v in sd.get("state_dict", sd).items()}
            net.load_state_dict(sd)
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(self.device)
        self.model = DDP(net, device_ids=[self.local_rank])
        # lr is tuned for 4 GPUs x 48
        self.opt = torch.optim.Adam(self.model.parameters(), lr=args.lr * self.world / 4)
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, args.epochs * len(self.train_loader))
        if self.rank == 0:
            os.makedirs(args.out, exist_ok=True)
            print(f"train boxes {len(self.train_set)}, val boxes {len(self.val_set)}", flush=True)

    def train_epoch(self, epoch):
        self.train_sampler.set_epoch(epoch)
        self.model.train()
        running = torch.zeros(2, device=self.device)
        for img, heat, vis, _, _ in self.train_loader:
            img, heat, vis = img.to(self.device, non_blocking=True), heat.to(self.device), vis.to(self.device)
            pred = self.model(img)
            loss = 0.5 * (((pred - heat) ** 2).mean((2, 3)) * vis).mean()
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.sched.step()
            running += torch.stack([loss.detach(), torch.ones((), device=self.device)])
        dist.all_reduce(running)
        return (running[0] / running[1]).item()

    @torch.no_grad()
    def validate(self, thr=0.2):
        self.model.eval()
        net = self.model.module
        correct = np.zeros(17)
        total = np.zeros(17)
        for img, _, vis, box, kp in self.val_loader:
            img = img.to(self.device, non_blocking=True)
            heat = net(img) + net(img.flip(3)).flip(3)[:, FLIP]
            n, j, h, w = heat.shape
            idx = heat.view(n, j, -1).argmax(2).cpu().numpy()
            xy = np.stack([idx % w, idx // w], -1) * 4.0
            box = box.numpy()
            img_xy = (xy - [W / 2, H / 2]) * (box[:, None, 2:3] / W) + box[:, None, :2]
            d = np.linalg.norm(img_xy - kp[..., :2].numpy(), axis=-1) / box[:, None, 3]
            v = vis.numpy() > 0
            correct += ((d <= thr) & v).sum(0)
            total += v.sum(0)
        stats = torch.from_numpy(np.stack([correct, total]))
        dist.all_reduce(stats)
        pck = stats[0] / stats[1].clamp(min=1)
        return pck.mean().item(), pck

    def fit(self):
        best = 0.0
        for epoch in range(self.args.epochs):
            t0 = time.time()
            loss = self.train_epoch(epoch)
            mean_pck, per_joint = self.validate()
            if self.rank == 0:
                print(f"epoch {epoch + 1}/{self.args.epochs} loss {loss:.6f} PCK@0.2 {mean_pck:.4f} "
                      f"({time.time() - t0:.0f}s)", flush=True)
                torch.save({"state_dict": self.model.module.state_dict(), "epoch": epoch + 1, "pck": mean_pck},
                           os.path.join(self.args.out, "last.pth"))
                if mean_pck > best:
                    best = mean_pck
                    torch.save({"state_dict": self.model.module.state_dict(), "epoch": epoch + 1, "pck": mean_pck},
                               os.path.join(self.args.out, "best.pth"))
        dist.destroy_process_group()


if __name__ == "__main__":
    Trainer(build_args()).fit()
