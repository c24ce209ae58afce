"""Top-down human pose estimation (SimpleBaseline-style ResNet + deconv heads) on COCO keypoints.
Person crops are pre-extracted to .npz shards by tools/extract_crops.py.

    torchrun --nproc_per_node=4 train_pose.py --config configs/res50_coco_256x192.yaml
"""
import argparse
import glob
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import resnet50, ResNet50_Weights

FLIP_PAIRS = [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12), (13, 14), (15, 16)]


class KeypointCrops(Dataset):
    def __init__(self, root, split, heatmap_size=(64, 48), sigma=2.0, train=True):
        self.files = sorted(glob.glob(os.path.join(root, split, "*.npz")))
        self.hm_h, self.hm_w = heatmap_size
        self.sigma, self.train = sigma, train

    def __len__(self):
        return len(self.files)

    def _heatmaps(self, kpts, img_h, img_w):
        hm = np.zeros((17, self.hm_h, self.hm_w), dtype=np.float32)
        weight = np.zeros(17, dtype=np.float32)
        ys, xs = np.mgrid[0:self.hm_h, 0:self.hm_w]
        for j, (x, y, v) in enumerate(kpts):
            if v < 1:
                continue
            cx, cy = x * self.hm_w / img_w, y * self.hm_h / img_h
            hm[j] = np.exp(-((xs - cx) ** 2 + (ys - cy) ** 2) / (2 * self.sigma ** 2))
            weight[j] = 1.0
        return hm, weight

    def __getitem__(self, i):
        d = np.load(self.files[i])
        img, kpts = d["image"].astype(np.float32) / 255.0, d["keypoints"].copy()  # (256,192,3), (17,3)
        h, w = img.shape[:2]
        if self.train and np.random.rand() < 0.5:
            img = img[:, ::-1]
            kpts[:, 0] = w - 1 - kpts[:, 0]
            for a, b in FLIP_PAIRS:
                kpts[[a, b]] = kpts[[b, a]]
        img = (img - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
        hm, weight = self._heatmaps(kpts, h, w)
        return (torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))).float(),
                torch.from_numpy(hm), torch.from_numpy(weight))


class PoseResNet(nn.Module):
    def __init__(self, num_joints=17):
        super().__init__()
        r = resnet50(weights=ResNet50_Weights.IMAGENET1K_V1)
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        layers, in_ch = [], 2048
        for _ in range(3):
            layers += [nn.ConvTranspose2d(in_ch, 256, 4, stride=2, padding=1, bias=False),
                       nn.BatchNorm2d(256), nn.ReLU(inplace=True)]
            in_ch = 256
        self.deconv = nn.Sequential(*layers)
        self.final = nn.Conv2d(256, num_joints, 1)

    def forward(self, x):
        return self.final(self.deconv(self.backbone(x)))


class JointsMSELoss(nn.Module):
    def forward(self, pred, target, weight):
        return (((pred - target) ** 2).mean(dim=(2, 3)) * weight).mean() * 0.5


def pck(pred, target, weight, thr=0.5):
    """PCK on heatmap argmax positions, threshold as a fraction of heatmap height / 10."""
    b, j, h, w = pred.shape
    p = pred.flatten(2).argmax(-1)
    t = target.flatten(2).argmax(-1)
    py, px, ty, tx = p // w, p % w, t // w, t % w
    d = ((py - ty) ** 2 + (px - tx) ** 2).float().sqrt()
    ok = (d < thr * h / 10 * 2).float() * weight
    return ok.sum(), weight.sum()


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.device = torch.device("cuda", self.local_rank)
        torch.cuda.set_device(self.local_rank)
        self.train_loader, self.train_sampler = self._build_loader("train")
        self.val_loader, _ = self._build_loader("val")
        self._init_distributed()
        self.logger = self._build_logger()
        self.model = self._build_model()
        self.criterion = JointsMSELoss()
        lr = cfg["lr"] * cfg["batch_per_gpu"] * self.world_size / cfg["base_batch"]
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.scheduler = torch.optim.lr_scheduler.MultiStepLR(self.optimizer, cfg["lr_steps"], 0.1)
        self.start_epoch, self.best_pck = 0, 0.0

    def _init_distributed(self):
        dist.init_process_group(backend="nccl")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def _build_logger(self):
        logger = logging.getLogger("pose")
        logger.setLevel(logging.INFO if self.rank == 0 else logging.ERROR)
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logger.addHandler(h)
        if self.rank == 0:
            os.makedirs(self.cfg["work_dir"], exist_ok=True)
            logger.addHandler(logging.FileHandler(os.path.join(self.cfg["work_dir"], "train.log")))
        return logger

    def _build_loader(self, split):
        train = split == "train"
        ds = KeypointCrops(self.cfg["data_root"], split, train=train)
        sampler = DistributedSampler(ds, shuffle=train, drop_last=train)
        loader = DataLoader(ds, batch_size=self.cfg["batch_per_gpu"], sampler=sampler,
                            num_workers=self.cfg["workers"], pin_memory=True, drop_last=train)
        return loader, sampler

    def _build_model(self):
        model = PoseResNet()
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(self.device)
        return DDP(model, device_ids=[self.local_rank])

    def save(self, epoch, name):
        if self.rank != 0:
            return
        torch.save({"epoch": epoch, "model": self.model.module.state_dict(),
                    "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                    "best_pck": self.best_pck}, os.path.join(self.cfg["work_dir"], name))

    def resume(self, path):
        ckpt = torch.load(path, map_location="cpu")
        self.model.module.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.start_epoch, self.best_pck = ckpt["epoch"] + 1, ckpt["best_pck"]

    def train_epoch(self, epoch):
        self.model.train()
        self.train_sampler.set_epoch(epoch)
        meter = torch.zeros(2, device=self.device)
        t0 = time.time()
        for i, (img, hm, w) in enumerate(self.train_loader):
            img, hm, w = img.to(self.device, non_blocking=True), hm.to(self.device), w.to(self.device)
            loss = self.criterion(self.model(img), hm, w)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            meter += torch.stack([loss.detach(), torch.ones((), device=self.device)])
            if i % self.cfg["print_freq"] == 0:
                self.logger.info(f"Epoch[{epoch}][{i}/{len(self.train_loader)}] loss(rank0) {loss.item():.6f} "
                                 f"{(time.time() - t0) / (i + 1):.3f}s/it")
        dist.all_reduce(meter)
        return (meter[0] / meter[1]).item()

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        acc = torch.zeros(2, device=self.device)
        for img, hm, w in self.val_loader:
            img, hm, w = img.to(self.device), hm.to(self.device), w.to(self.device)
            pred = self.model(img)
            flipped = self.model(img.flip(-1)).flip(-1)
            for a, b in FLIP_PAIRS:
                flipped[:, [a, b]] = flipped[:, [b, a]]
            ok, n = pck((pred + flipped) / 2, hm, w)
            acc += torch.stack([ok, n])
        dist.all_reduce(acc)
        return (acc[0] / acc[1].clamp(min=1)).item()

    def fit(self):
        if self.cfg.get("resume"):
            self.resume(self.cfg["resume"])
        for epoch in range(self.start_epoch, self.cfg["epochs"]):
            train_loss = self.train_epoch(epoch)
            self.scheduler.step()
            val_pck = self.validate()
            self.logger.info(f"epoch {epoch} train_loss {train_loss:.6f} val PCK@0.5 {val_pck:.4f}")
            self.save(epoch, "latest.pth")
            if val_pck > self.best_pck:
                self.best_pck = val_pck
                self.save(epoch, "best.pth")
            dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    trainer = Trainer(cfg)
    trainer.fit()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
