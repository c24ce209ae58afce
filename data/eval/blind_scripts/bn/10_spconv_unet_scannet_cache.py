"""
Sparse 3D UNet (spconv 2.x) for ScanNet v2 semantic segmentation.

Raw scans (*_vh_clean_2.ply + *.labels.ply) are converted once into compact .npz
files under <data_root>/cache the first time the dataset is built.

    torchrun --nnodes=1 --nproc_per_node=8 train_spunet.py --data_root /data/scannet --exp spunet_2cm
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from plyfile import PlyData
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

import spconv.pytorch as spconv

NYU40_TO_SCANNET20 = {c: i for i, c in enumerate([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14, 16, 24, 28, 33, 34, 36, 39])}
IGNORE = -1


def read_scan(scan_dir, scene):
    v = PlyData.read(os.path.join(scan_dir, scene, f"{scene}_vh_clean_2.ply"))["vertex"]
    xyz = np.stack([v["x"], v["y"], v["z"]], 1).astype(np.float32)
    rgb = np.stack([v["red"], v["green"], v["blue"]], 1).astype(np.uint8)
    lab = PlyData.read(os.path.join(scan_dir, scene, f"{scene}_vh_clean_2.labels.ply"))["vertex"]["label"]
    lab = np.array([NYU40_TO_SCANNET20.get(int(l), IGNORE) for l in lab], dtype=np.int16)
    return xyz, rgb, lab


class ScanNetSparse(Dataset):
    def __init__(self, data_root, split, voxel_size=0.02, train=True):
        self.scan_dir = os.path.join(data_root, "scans")
        self.cache_dir = os.path.join(data_root, "cache")
        with open(os.path.join(data_root, f"scannetv2_{split}.txt")) as f:
            self.scenes = [s.strip() for s in f if s.strip()]
        self.voxel_size, self.train = voxel_size, train
        index_file = os.path.join(self.cache_dir, f"{split}_index.json")
        if not os.path.exists(index_file):
            self._build_cache(index_file)
        with open(index_file) as f:
            self.num_points = json.load(f)

    def _build_cache(self, index_file):
        os.makedirs(self.cache_dir, exist_ok=True)
        sizes = {}
        for scene in self.scenes:
            xyz, rgb, lab = read_scan(self.scan_dir, scene)
            np.savez(os.path.join(self.cache_dir, scene + ".npz"), xyz=xyz, rgb=rgb, label=lab)
            sizes[scene] = int(len(xyz))
        with open(index_file, "w") as f:
            json.dump(sizes, f)

    def __len__(self):
        return len(self.scenes)

    def __getitem__(self, i):
        d = np.load(os.path.join(self.cache_dir, self.scenes[i] + ".npz"))
        xyz, rgb, lab = d["xyz"], d["rgb"].astype(np.float32) / 127.5 - 1, d["label"].astype(np.int64)
        if self.train:
            a = np.random.uniform(0, 2 * np.pi)
            rot = np.array([[np.cos(a), -np.sin(a), 0], [np.sin(a), np.cos(a), 0], [0, 0, 1]], np.float32)
            xyz = (xyz @ rot.T) * np.random.uniform(0.9, 1.1)
            xyz += np.random.normal(0, 0.005, xyz.shape).astype(np.float32)
        grid = np.floor((xyz - xyz.min(0)) / self.voxel_size).astype(np.int32)
        _, keep = np.unique(grid, axis=0, return_index=True)
        return dict(grid=grid[keep], feat=np.concatenate([rgb, xyz - xyz.mean(0)], 1)[keep], label=lab[keep],
                    scene=self.scenes[i])


def collate(batch):
    grids = [torch.from_numpy(np.pad(b["grid"], ((0, 0), (1, 0)), constant_values=i)) for i, b in enumerate(batch)]
    out = {"coords": torch.cat(grids).int(),
           "feat": torch.from_numpy(np.concatenate([b["feat"] for b in batch])).float(),
           "label": torch.from_numpy(np.concatenate([b["label"] for b in batch])),
           "spatial_shape": np.max(np.concatenate([b["grid"] for b in batch]), 0) + 1,
           "batch_size": len(batch), "scene": [b["scene"] for b in batch]}
    return out


def conv_bn(cin, cout, key, subm=True, stride=1, transposed=False):
    if subm:
        conv = spconv.SubMConv3d(cin, cout, 3, padding=1, bias=False, indice_key=key)
    elif transposed:
        conv = spconv.SparseInverseConv3d(cin, cout, 2, bias=False, indice_key=key)
    else:
        conv = spconv.SparseConv3d(cin, cout, 2, stride=stride, bias=False, indice_key=key)
    return spconv.SparseSequential(conv, nn.BatchNorm1d(cout), nn.ReLU(inplace=True))


class SpUNet(nn.Module):
    def __init__(self, in_ch=6, num_classes=20, planes=(32, 64, 128, 256)):
        super().__init__()
        self.stem = spconv.SparseSequential(conv_bn(in_ch, planes[0], "s0"), conv_bn(planes[0], planes[0], "s0"))
        self.down, self.enc, self.up, self.dec = nn.ModuleList(), nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
        for i in range(1, len(planes)):
            self.down.append(conv_bn(planes[i - 1], planes[i], f"d{i}", subm=False, stride=2))
            self.enc.append(spconv.SparseSequential(conv_bn(planes[i], planes[i], f"s{i}"),
                                                    conv_bn(planes[i], planes[i], f"s{i}")))
            self.up.append(conv_bn(planes[i], planes[i - 1], f"d{i}", subm=False, transposed=True))
            self.dec.append(conv_bn(planes[i - 1] * 2, planes[i - 1], f"s{i - 1}"))
        self.head = nn.Linear(planes[0], num_classes)

    def forward(self, x):
        x = self.stem(x)
        skips = [x]
        for down, enc in zip(self.down, self.enc):
            x = enc(down(x))
            skips.append(x)
        skips.pop()
        for up, dec in zip(reversed(self.up), reversed(self.dec)):
            x = up(x)
            skip = skips.pop()
            x = x.replace_feature(torch.cat([x.features, skip.features], 1))
            x = dec(x)
        return self.head(x.features)


def run(model, batch, device):
    x = spconv.SparseConvTensor(batch["feat"].to(device, non_blocking=True), batch["coords"].to(device),
                                batch["spatial_shape"].tolist(), batch["batch_size"])
    return model(x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_root", default="/data/scannet")
    ap.add_argument("--exp", default="spunet")
    ap.add_argument("--voxel_size", type=float, default=0.02)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--lr", type=float, default=0.05, help="for 32 scenes per step")
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    out_dir = os.path.join("exp", args.exp)
    writer = None
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        writer = SummaryWriter(out_dir)

    train_set = ScanNetSparse(args.data_root, "train", args.voxel_size, train=True)
    val_set = ScanNetSparse(args.data_root, "val", args.voxel_size, train=False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                              collate_fn=collate, drop_last=True, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)), 1,
                            num_workers=args.workers, collate_fn=collate)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(SpUNet()).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 32
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    iters = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=iters, pct_start=0.05,
                                                    anneal_strategy="cos", div_factor=10, final_div_factor=1000)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, batch in enumerate(train_loader):
            logits = run(model, batch, device)
            loss = F.cross_entropy(logits, batch["label"].to(device), ignore_index=IGNORE)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and i % 20 == 0:
                writer.add_scalar("train/loss", loss.item(), epoch * len(train_loader) + i)
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.5f} {time.time() - t0:.0f}s")

        if (epoch + 1) % 10 == 0:
            model.eval()
            inter = torch.zeros(20, device=device)
            union = torch.zeros(20, device=device)
            with torch.no_grad():
                for batch in val_loader:
                    pred = run(model.module, batch, device).argmax(1)
                    gt = batch["label"].to(device)
                    valid = gt != IGNORE
                    p, g = pred[valid], gt[valid]
                    for c in range(20):
                        inter[c] += ((p == c) & (g == c)).sum()
                        union[c] += ((p == c) | (g == c)).sum()
            dist.all_reduce(inter)
            dist.all_reduce(union)
            miou = (inter / union.clamp(min=1)).mean().item()
            if rank == 0:
                print(f"epoch {epoch} val mIoU (voxels) {miou:.4f}")
                writer.add_scalar("val/miou", miou, epoch)
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict()}, os.path.join(out_dir, "last.pth"))
                if miou > best:
                    best = miou
                    torch.save(model.module.state_dict(), os.path.join(out_dir, "best.pth"))
            dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
