"""
MVSNet on DTU (train 128x160 crops of the 512x640 rectified images, 192 depth hypotheses).

    torchrun --nproc_per_node=4 train_mvsnet.py --trainpath data/dtu_training --logdir ./checkpoints/mvsnet
"""
import argparse
import os
import re
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

parser = argparse.ArgumentParser(description="MVSNet DDP")
parser.add_argument("--trainpath", default="data/dtu_training")
parser.add_argument("--trainlist", default="lists/dtu/train.txt")
parser.add_argument("--vallist", default="lists/dtu/val.txt")
parser.add_argument("--logdir", default="./checkpoints/mvsnet")
parser.add_argument("--epochs", type=int, default=16)
parser.add_argument("--lr", type=float, default=0.001, help="for a total batch of 16")
parser.add_argument("--lrepochs", default="10,12,14:2")
parser.add_argument("--batch_size", type=int, default=4, help="per GPU")
parser.add_argument("--numdepth", type=int, default=192)
parser.add_argument("--interval_scale", type=float, default=1.06)
parser.add_argument("--nviews", type=int, default=3)
parser.add_argument("--summary_freq", type=int, default=50)


def read_pfm(filename):
    with open(filename, "rb") as f:
        header = f.readline().decode("utf-8").rstrip()
        w, h = map(int, re.match(r"^(\d+)\s(\d+)\s$", f.readline().decode("utf-8")).groups())
        scale = float(f.readline().rstrip())
        data = np.fromfile(f, "<f" if scale < 0 else ">f").reshape(h, w, 3 if header == "PF" else 1)
    return np.flipud(data).squeeze().copy()


class DTUDataset(Dataset):
    def __init__(self, root, listfile, mode, nviews, ndepths, interval_scale):
        self.root, self.mode, self.nviews, self.ndepths, self.interval_scale = root, mode, nviews, ndepths, interval_scale
        scans = [l.strip() for l in open(listfile)]
        self.metas = []
        for scan in scans:
            with open(os.path.join(root, "Cameras/pair.txt")) as f:
                n = int(f.readline())
                for _ in range(n):
                    ref = int(f.readline().rstrip())
                    src = [int(x) for x in f.readline().rstrip().split()[1::2]]
                    for light in range(7):
                        self.metas.append((scan, light, ref, src))

    def __len__(self):
        return len(self.metas)

    def read_cam(self, vid):
        lines = [l.rstrip() for l in open(os.path.join(self.root, f"Cameras/train/{vid:08d}_cam.txt"))]
        extr = np.array(" ".join(lines[1:5]).split(), dtype=np.float32).reshape(4, 4)
        intr = np.array(" ".join(lines[7:10]).split(), dtype=np.float32).reshape(3, 3)
        dmin, dint = map(float, lines[11].split()[:2])
        return intr, extr, dmin, dint * self.interval_scale

    def __getitem__(self, idx):
        scan, light, ref, src = self.metas[idx]
        vids = [ref] + src[: self.nviews - 1]
        imgs, projs = [], []
        for i, vid in enumerate(vids):
            img = cv2.imread(os.path.join(self.root, f"Rectified/{scan}_train/rect_{vid + 1:03d}_{light}_r5000.png"))
            imgs.append(cv2.cvtColor(img, cv2.COLOR_BGR2RGB).astype(np.float32) / 255.0)
            intr, extr, dmin, dint = self.read_cam(vid)
            proj = extr.copy()
            proj[:3, :4] = intr @ extr[:3, :4] / np.array([[4], [4], [1]], np.float32)   # features at 1/4 res
            projs.append(proj)
            if i == 0:
                depth_values = np.arange(dmin, dint * self.ndepths + dmin, dint, dtype=np.float32)[: self.ndepths]
                depth = read_pfm(os.path.join(self.root, f"Depths/{scan}_train/depth_map_{vid:04d}.pfm"))
                mask = (depth > 0).astype(np.float32)
        imgs = np.stack(imgs).transpose(0, 3, 1, 2)
        imgs = (imgs - imgs.mean(axis=(2, 3), keepdims=True)) / (imgs.std(axis=(2, 3), keepdims=True) + 1e-8)
        return {"imgs": imgs, "proj_matrices": np.stack(projs), "depth": depth, "mask": mask,
                "depth_values": depth_values}


def cbr(cin, cout, k=3, s=1, d3=False):
    Conv, BN = (nn.Conv3d, nn.BatchNorm3d) if d3 else (nn.Conv2d, nn.BatchNorm2d)
    return nn.Sequential(Conv(cin, cout, k, s, k // 2, bias=False), BN(cout), nn.ReLU(inplace=True))


class FeatureNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(cbr(3, 8), cbr(8, 8), cbr(8, 16, 5, 2), cbr(16, 16), cbr(16, 16),
                                 cbr(16, 32, 5, 2), cbr(32, 32), nn.Conv2d(32, 32, 3, 1, 1))

    def forward(self, x):
        return self.net(x)


class CostRegNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c0, self.c1, self.c2 = cbr(32, 8, d3=True), cbr(8, 16, s=2, d3=True), cbr(16, 16, d3=True)
        self.c3, self.c4 = cbr(16, 32, s=2, d3=True), cbr(32, 32, d3=True)
        self.u1 = nn.Sequential(nn.ConvTranspose3d(32, 16, 3, 2, 1, 1, bias=False), nn.BatchNorm3d(16), nn.ReLU(True))
        self.u2 = nn.Sequential(nn.ConvTranspose3d(16, 8, 3, 2, 1, 1, bias=False), nn.BatchNorm3d(8), nn.ReLU(True))
        self.prob = nn.Conv3d(8, 1, 3, 1, 1)

    def forward(self, x):
        c0 = self.c0(x)
        c2 = self.c2(self.c1(c0))
        x = self.c4(self.c3(c2))
        x = c2 + self.u1(x)
        x = c0 + self.u2(x)
        return self.prob(x)


def homo_warping(src_fea, src_proj, ref_proj, depth_values):
    b, c, h, w = src_fea.shape
    nd = depth_values.shape[1]
    with torch.no_grad():
        proj = src_proj @ torch.inverse(ref_proj)
        rot, trans = proj[:, :3, :3], proj[:, :3, 3:4]
        y, x = torch.meshgrid(torch.arange(h, device=src_fea.device, dtype=torch.float32),
                              torch.arange(w, device=src_fea.device, dtype=torch.float32), indexing="ij")
        xyz = torch.stack([x.flatten(), y.flatten(), torch.ones_like(x).flatten()]).unsqueeze(0).repeat(b, 1, 1)
        rot_xyz = (rot @ xyz).unsqueeze(2).repeat(1, 1, nd, 1) * depth_values.view(b, 1, nd, 1)
        proj_xyz = rot_xyz + trans.view(b, 3, 1, 1)
        proj_xy = proj_xyz[:, :2] / proj_xyz[:, 2:3].clamp(min=1e-6)
        grid = torch.stack([proj_xy[:, 0] / ((w - 1) / 2) - 1, proj_xy[:, 1] / ((h - 1) / 2) - 1], dim=3)
    warped = F.grid_sample(src_fea, grid.view(b, nd * h, w, 2), mode="bilinear", padding_mode="zeros",
                           align_corners=True)
    return warped.view(b, c, nd, h, w)


class MVSNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.feature, self.cost_regularization = FeatureNet(), CostRegNet()

    def forward(self, imgs, proj_matrices, depth_values):
        feats = [self.feature(imgs[:, i]) for i in range(imgs.shape[1])]
        ref_feat, ref_proj = feats[0], proj_matrices[:, 0]
        nd = depth_values.shape[1]
        ref_vol = ref_feat.unsqueeze(2).repeat(1, 1, nd, 1, 1)
        vol_sum, vol_sq = ref_vol, ref_vol ** 2
        for src_fea, i in zip(feats[1:], range(1, imgs.shape[1])):
            warped = homo_warping(src_fea, proj_matrices[:, i], ref_proj, depth_values)
            vol_sum = vol_sum + warped
            vol_sq = vol_sq + warped ** 2
        n = imgs.shape[1]
        variance = vol_sq / n - (vol_sum / n) ** 2
        prob = F.softmax(self.cost_regularization(variance).squeeze(1), dim=1)
        depth = (prob * depth_values.view(-1, nd, 1, 1)).sum(1)
        return depth


def mvs_loss(depth_est, depth_gt, mask):
    m = mask > 0.5
    return F.smooth_l1_loss(depth_est[m], depth_gt[m], reduction="mean")


def to_cuda(sample, device):
    return {k: torch.as_tensor(v).to(device, non_blocking=True) for k, v in sample.items()}


def reduce_mean(t):
    t = t.clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    sums = torch.zeros(4, device=device)   # abs err, <2mm, <4mm, count
    for sample in loader:
        s = to_cuda(sample, device)
        gt = F.interpolate(s["depth"].unsqueeze(1), scale_factor=0.25, mode="nearest").squeeze(1)
        mask = F.interpolate(s["mask"].unsqueeze(1), scale_factor=0.25, mode="nearest").squeeze(1) > 0.5
        est = model(s["imgs"], s["proj_matrices"], s["depth_values"])
        err = (est - gt).abs()[mask]
        sums += torch.stack([err.sum(), (err < 2).float().sum(), (err < 4).float().sum(),
                             torch.tensor(float(err.numel()), device=device)])
    sums = reduce_mean(sums)
    model.train()
    return {"abs_depth_error": (sums[0] / sums[3]).item(), "thres2mm": (sums[1] / sums[3]).item(),
            "thres4mm": (sums[2] / sums[3]).item()}


def main():
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    train_ds = DTUDataset(args.trainpath, args.trainlist, "train", args.nviews, args.numdepth, args.interval_scale)
    val_ds = DTUDataset(args.trainpath, args.vallist, "val", 5, args.numdepth, args.interval_scale)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=8, drop_last=True,
                              pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=1, shuffle=False, num_workers=4)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(MVSNet()).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * dist.get_world_size() / 16
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    milestones, gamma = args.lrepochs.split(":")
    scheduler = torch.optim.lr_scheduler.MultiStepLR(
        optimizer, [int(e) * len(train_loader) for e in milestones.split(",")], gamma=1 / float(gamma))

    writer = None
    if rank == 0:
        os.makedirs(args.logdir, exist_ok=True)
        writer = SummaryWriter(args.logdir)

    global_step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, sample in enumerate(train_loader):
            t0 = time.time()
            s = to_cuda(sample, device)
            # supervise at the resolution of the feature maps
            gt = F.interpolate(s["depth"].unsqueeze(1), scale_factor=0.25, mode="nearest").squeeze(1)
            mask = F.interpolate(s["mask"].unsqueeze(1), scale_factor=0.25, mode="nearest").squeeze(1)
            depth_est = model(s["imgs"], s["proj_matrices"], s["depth_values"])
            loss = mvs_loss(depth_est, gt, mask)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            global_step += 1
            if global_step % args.summary_freq == 0:
                loss_avg = reduce_mean(loss.detach())
                if rank == 0:
                    writer.add_scalar("train/loss", loss_avg.item(), global_step)
                    print(f"Epoch {epoch}/{args.epochs}, Iter {it}/{len(train_loader)}, "
                          f"loss = {loss_avg.item():.3f}, time = {time.time() - t0:.3f}", flush=True)

        if rank == 0:
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                       os.path.join(args.logdir, f"model_{epoch:06d}.ckpt"))
            metrics = validate(model.module, val_loader, device)
            for k, v in metrics.items():
                writer.add_scalar(f"val/{k}", v, global_step)
            print(f"epoch {epoch} val {metrics}", flush=True)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
