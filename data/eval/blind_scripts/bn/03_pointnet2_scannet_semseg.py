# PointNet++ (SSG) semantic segmentation on ScanNet v2, 20 classes.
# Scenes are cut into 1.5m x 1.5m columns with 8192 points each (see prepare_scannet.py).
#
#   torchrun --nproc_per_node=8 train_scannet_pn2.py --data_dir data/scannet_chunks --batch_size 2
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from pointnet2_ops import pointnet2_utils

NUM_CLASSES = 20
IGNORE = -100


class ScanNetChunks(Dataset):
    def __init__(self, data_dir, split, num_points=8192, augment=False):
        with open(os.path.join(data_dir, f"scannetv2_{split}.txt")) as f:
            scenes = [l.strip() for l in f if l.strip()]
        self.files = sorted(os.path.join(data_dir, split, s + ".npz") for s in scenes)
        self.num_points = num_points
        self.augment = augment

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        data = np.load(self.files[idx])
        xyz, rgb, label = data["xyz"].astype(np.float32), data["rgb"].astype(np.float32), data["label"]
        # random column of the scene
        center = xyz[np.random.randint(len(xyz))]
        m = (np.abs(xyz[:, 0] - center[0]) < 0.75) & (np.abs(xyz[:, 1] - center[1]) < 0.75)
        idxs = np.where(m)[0]
        choice = np.random.choice(idxs, self.num_points, replace=len(idxs) < self.num_points)
        xyz, rgb, label = xyz[choice], rgb[choice] / 127.5 - 1.0, label[choice].astype(np.int64)
        xyz = xyz - np.array([center[0], center[1], xyz[:, 2].min()], dtype=np.float32)
        if self.augment:
            theta = np.random.uniform(0, 2 * np.pi)
            c, s = np.cos(theta), np.sin(theta)
            xyz = xyz @ np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]], dtype=np.float32).T
            xyz *= np.random.uniform(0.9, 1.1)
            xyz += np.random.normal(0, 0.01, xyz.shape).astype(np.float32)
        return torch.from_numpy(xyz), torch.from_numpy(rgb), torch.from_numpy(label)


class SetAbstraction(nn.Module):
    def __init__(self, npoint, radius, nsample, in_ch, mlp):
        super().__init__()
        self.npoint = npoint
        self.grouper = pointnet2_utils.QueryAndGroup(radius, nsample, use_xyz=True)
        layers, c = [], in_ch + 3
        for out in mlp:
            layers += [nn.Conv2d(c, out, 1, bias=False), nn.BatchNorm2d(out), nn.ReLU(inplace=True)]
            c = out
        self.mlp = nn.Sequential(*layers)

    def forward(self, xyz, feats):
        idx = pointnet2_utils.furthest_point_sample(xyz, self.npoint)
        new_xyz = pointnet2_utils.gather_operation(xyz.transpose(1, 2).contiguous(), idx).transpose(1, 2).contiguous()
        grouped = self.grouper(xyz, new_xyz, feats)           # B, C+3, npoint, nsample
        return new_xyz, self.mlp(grouped).max(dim=-1)[0]


class FeaturePropagation(nn.Module):
    def __init__(self, in_ch, mlp):
        super().__init__()
        layers, c = [], in_ch
        for out in mlp:
            layers += [nn.Conv1d(c, out, 1, bias=False), nn.BatchNorm1d(out), nn.ReLU(inplace=True)]
            c = out
        self.mlp = nn.Sequential(*layers)

    def forward(self, xyz_dst, xyz_src, feats_dst, feats_src):
        dist_, idx = pointnet2_utils.three_nn(xyz_dst, xyz_src)
        w = 1.0 / (dist_ + 1e-8)
        w = w / w.sum(dim=2, keepdim=True)
        interp = pointnet2_utils.three_interpolate(feats_src, idx, w)
        if feats_dst is not None:
            interp = torch.cat([interp, feats_dst], dim=1)
        return self.mlp(interp)


class PointNet2SemSeg(nn.Module):
    def __init__(self, num_classes, in_ch=3):
        super().__init__()
        self.sa1 = SetAbstraction(1024, 0.1, 32, in_ch, [32, 32, 64])
        self.sa2 = SetAbstraction(256, 0.2, 32, 64, [64, 64, 128])
        self.sa3 = SetAbstraction(64, 0.4, 32, 128, [128, 128, 256])
        self.sa4 = SetAbstraction(16, 0.8, 32, 256, [256, 256, 512])
        self.fp4 = FeaturePropagation(768, [256, 256])
        self.fp3 = FeaturePropagation(384, [256, 256])
        self.fp2 = FeaturePropagation(320, [256, 128])
        self.fp1 = FeaturePropagation(128 + in_ch, [128, 128, 128])
        self.head = nn.Sequential(nn.Conv1d(128, 128, 1, bias=False), nn.BatchNorm1d(128), nn.ReLU(True),
                                  nn.Dropout(0.5), nn.Conv1d(128, num_classes, 1))

    def forward(self, xyz, feats):
        l1_xyz, l1 = self.sa1(xyz, feats)
        l2_xyz, l2 = self.sa2(l1_xyz, l1)
        l3_xyz, l3 = self.sa3(l2_xyz, l2)
        l4_xyz, l4 = self.sa4(l3_xyz, l3)
        l3 = self.fp4(l3_xyz, l4_xyz, l3, l4)
        l2 = self.fp3(l2_xyz, l3_xyz, l2, l3)
        l1 = self.fp2(l1_xyz, l2_xyz, l1, l2)
        l0 = self.fp1(xyz, l1_xyz, feats, l1)
        return self.head(l0)


def confusion(pred, target, n):
    valid = target != IGNORE
    return torch.bincount(target[valid] * n + pred[valid], minlength=n * n).view(n, n)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    conf = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long, device=device)
    for xyz, rgb, label in loader:
        xyz, rgb, label = xyz.to(device), rgb.to(device), label.to(device)
        logits = model(xyz, rgb.transpose(1, 2).contiguous())
        conf += confusion(logits.argmax(1).flatten(), label.flatten(), NUM_CLASSES)
    dist.all_reduce(conf)
    iou = conf.diag().float() / (conf.sum(0) + conf.sum(1) - conf.diag()).float().clamp(min=1)
    model.train()
    return iou.mean().item(), (conf.diag().sum().float() / conf.sum().clamp(min=1)).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_dir", default="data/scannet_chunks")
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--num_points", type=int, default=8192)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--save_dir", default="checkpoints/pn2_scannet")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(format="[%(asctime)s] %(message)s", level=logging.INFO if rank == 0 else logging.ERROR)
    logger = logging.getLogger(__name__)
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    train_set = ScanNetChunks(args.data_dir, "train", args.num_points, augment=True)
    val_set = ScanNetChunks(args.data_dir, "val", args.num_points, augment=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    # shard the validation scenes without padding so every scene is counted once
    val_subset = torch.utils.data.Subset(val_set, range(rank, len(val_set), world_size))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_subset, batch_size=args.batch_size, num_workers=args.workers)

    model = PointNet2SemSeg(NUM_CLASSES).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)

    lr = args.lr * world_size * args.batch_size / 16
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=40, gamma=0.5)
    weights = torch.ones(NUM_CLASSES, device=device)

    best_miou = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(2, device=device)
        tic = time.time()
        for xyz, rgb, label in train_loader:
            xyz = xyz.to(device, non_blocking=True)
            rgb = rgb.to(device, non_blocking=True).transpose(1, 2).contiguous()
            label = label.to(device, non_blocking=True)
            logits = model(xyz, rgb)
            loss = F.cross_entropy(logits, label, weight=weights, ignore_index=IGNORE)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(running)
        logger.info(f"epoch {epoch} loss {running[0].item() / running[1].item():.4f} "
                    f"lr {scheduler.get_last_lr()[0]:.2e} time {time.time() - tic:.0f}s")

        if (epoch + 1) % 5 == 0:
            miou, acc = validate(model.module, val_loader, device)
            logger.info(f"epoch {epoch} val mIoU {miou:.4f} acc {acc:.4f}")
            if rank == 0:
                state = {"epoch": epoch, "model": model.module.state_dict(),
                         "optimizer": optimizer.state_dict(), "miou": miou}
                torch.save(state, os.path.join(args.save_dir, "last.pth"))
                if miou > best_miou:
                    best_miou = miou
                    torch.save(state, os.path.join(args.save_dir, "best.pth"))
            dist.barrier()

    logger.info(f"best val mIoU {best_miou:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
