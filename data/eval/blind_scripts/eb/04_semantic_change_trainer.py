"""Semantic change detection ("from-to" land-cover transitions) on Sentinel-2 pairs.

Shared encoder, one land-cover head per date and a binary change head
(HRSCD strategy 4 style). Patches: <root>/<split>/<id>.npz with
    im1, im2 : (10, 256, 256) float16, already scaled to reflectance
    lc1, lc2 : (256, 256) uint8 land-cover class, 255 = unlabelled
    cd       : (256, 256) uint8 0/1

    torchrun --nproc_per_node=4 04_semantic_change_trainer.py --root /data/s2_scd --epochs 80
"""
import argparse
import glob
import logging
import os

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["water", "bare", "low_veg", "tree", "cropland", "built_up", "wetland"]
NC = len(CLASSES)
IGNORE = 255
logger = logging.getLogger(__name__)


class SCDPatches(Dataset):
    def __init__(self, root, split, augment=False):
        self.files = sorted(glob.glob(os.path.join(root, split, "*.npz")))
        self.augment = augment

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        z = np.load(self.files[i])
        im1, im2 = z["im1"].astype(np.float32), z["im2"].astype(np.float32)
        lc1, lc2, cd = z["lc1"].astype(np.int64), z["lc2"].astype(np.int64), z["cd"].astype(np.float32)
        if self.augment:
            k = np.random.randint(4)
            im1, im2 = np.rot90(im1, k, (1, 2)), np.rot90(im2, k, (1, 2))
            lc1, lc2, cd = np.rot90(lc1, k), np.rot90(lc2, k), np.rot90(cd, k)
        arr = [np.ascontiguousarray(v) for v in (im1, im2, lc1, lc2, cd)]
        return tuple(torch.from_numpy(v) for v in arr)


class SCDNet(nn.Module):
    def __init__(self, backbone="resnet50", in_chans=10):
        super().__init__()
        self.enc = timm.create_model(backbone, features_only=True, in_chans=in_chans,
                                     out_indices=(1, 2, 3, 4), pretrained=False)
        chs = self.enc.feature_info.channels()
        self.lat = nn.ModuleList([nn.Conv2d(c, 128, 1) for c in chs])

        def head(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, 128, 3, padding=1), nn.BatchNorm2d(128),
                                 nn.ReLU(inplace=True), nn.Conv2d(128, cout, 1))
        self.seg_head = head(128, NC)
        self.cd_head = head(256, 1)

    def fpn(self, x):
        feats = [l(f) for l, f in zip(self.lat, self.enc(x))]
        out = feats[-1]
        for f in reversed(feats[:-1]):
            out = f + F.interpolate(out, size=f.shape[-2:], mode="nearest")
        return out

    def forward(self, x1, x2):
        f1, f2 = self.fpn(x1), self.fpn(x2)
        size = x1.shape[-2:]
        s1 = F.interpolate(self.seg_head(f1), size=size, mode="bilinear", align_corners=False)
        s2 = F.interpolate(self.seg_head(f2), size=size, mode="bilinear", align_corners=False)
        c = F.interpolate(self.cd_head(torch.cat([f1, f2], 1)), size=size, mode="bilinear",
                          align_corners=False)
        return s1, s2, c.squeeze(1)


def fast_hist(pred, gt, n):
    k = (gt >= 0) & (gt < n)
    return np.bincount(n * gt[k].astype(int) + pred[k], minlength=n * n).reshape(n, n)


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group(backend="nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        logging.basicConfig(level=logging.INFO if self.rank == 0 else logging.ERROR)

        train_set = SCDPatches(args.root, "train", augment=True)
        val_set = SCDPatches(args.root, "val")
        self.sampler = DistributedSampler(train_set, shuffle=True)
        self.train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=self.sampler,
                                       num_workers=args.workers, pin_memory=True, drop_last=True)
        shard = Subset(val_set, range(self.rank, len(val_set), self.world))
        self.val_loader = DataLoader(shard, batch_size=args.batch_size, num_workers=args.workers,
                                     pin_memory=True)

        net = SCDNet(args.backbone).to(self.device)
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
        self.model = DDP(net, device_ids=[self.local_rank])
        lr = args.lr * self.world  # lr given per GPU
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9,
                                   weight_decay=args.weight_decay, nesterov=True)
        iters = args.epochs * len(self.train_loader)
        self.sched = torch.optim.lr_scheduler.PolynomialLR(self.opt, total_iters=iters, power=0.9)
        self.best_score = 0.0
        if self.rank == 0:
            os.makedirs(args.out_dir, exist_ok=True)

    def train_epoch(self, epoch):
        self.model.train()
        self.sampler.set_epoch(epoch)
        for it, (x1, x2, l1, l2, cd) in enumerate(self.train_loader):
            x1, x2 = x1.to(self.device, non_blocking=True), x2.to(self.device, non_blocking=True)
            l1, l2 = l1.to(self.device, non_blocking=True), l2.to(self.device, non_blocking=True)
            cd = cd.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                s1, s2, c = self.model(x1, x2)
            loss_seg = (F.cross_entropy(s1.float(), l1, ignore_index=IGNORE)
                        + F.cross_entropy(s2.float(), l2, ignore_index=IGNORE)) / 2
            loss_cd = F.binary_cross_entropy_with_logits(c.float(), cd, pos_weight=torch.tensor(3.0, device=self.device))
            loss = loss_seg + self.args.cd_weight * loss_cd
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.sched.step()
            if it % 50 == 0:
                logger.info("ep %d it %d seg %.3f cd %.3f", epoch, it, loss_seg.item(), loss_cd.item())

    @torch.no_grad()
    def validate(self):
        net = self.model.module
        net.eval()
        hist = np.zeros((NC, NC), dtype=np.int64)
        cd_hist = np.zeros((2, 2), dtype=np.int64)
        for x1, x2, l1, l2, cd in self.val_loader:
            s1, s2, c = net(x1.to(self.device), x2.to(self.device))
            p1, p2 = s1.argmax(1).cpu().numpy(), s2.argmax(1).cpu().numpy()
            pc = (c > 0).long().cpu().numpy()
            hist += fast_hist(p1.ravel(), l1.numpy().ravel(), NC)
            hist += fast_hist(p2.ravel(), l2.numpy().ravel(), NC)
            cd_hist += fast_hist(pc.ravel(), cd.numpy().astype(np.int64).ravel(), 2)
        hist_t = torch.from_numpy(hist)
        cd_t = torch.from_numpy(cd_hist)
        dist.all_reduce(hist_t)
        dist.all_reduce(cd_t)
        hist, cd_hist = hist_t.numpy(), cd_t.numpy()
        iou = np.diag(hist) / np.maximum(1, hist.sum(0) + hist.sum(1) - np.diag(hist))
        cd_iou = cd_hist[1, 1] / max(1, cd_hist[1, 1] + cd_hist[0, 1] + cd_hist[1, 0])
        return float(np.nanmean(iou)), float(cd_iou), iou

    def save(self, name, epoch):
        if self.rank != 0:
            return
        torch.save({"epoch": epoch, "model": self.model.module.state_dict(),
                    "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict()},
                   os.path.join(self.args.out_dir, name))

    def fit(self):
        for epoch in range(self.args.epochs):
            self.train_epoch(epoch)
            miou, cd_iou, per_class = self.validate()
            score = 0.3 * miou + 0.7 * cd_iou
            logger.info("epoch %d mIoU %.4f cdIoU %.4f score %.4f", epoch, miou, cd_iou, score)
            logger.info("per-class IoU: %s", ", ".join(f"{n}={v:.3f}" for n, v in zip(CLASSES, per_class)))
            self.save("last.pth", epoch)
            if score > self.best_score:
                self.best_score = score
                self.save("best.pth", epoch)
        dist.barrier()
        dist.destroy_process_group()


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/s2_scd")
    ap.add_argument("--out-dir", default="checkpoints/scd_r50")
    ap.add_argument("--backbone", default="resnet50")
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--weight-decay", type=float, default=5e-4)
    ap.add_argument("--cd-weight", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=6)
    return ap.parse_args()


if __name__ == "__main__":
    Trainer(parse_args()).fit()
