"""
Point Transformer (v1) semantic segmentation on ScanNet, voxelized at 2cm,
offset-format batches (points of all scenes concatenated).

    torchrun --nproc_per_node=8 train_ptv1.py --data_root data/scannet_pt --save_path exp/ptv1 \
        [--resume exp/ptv1/model/model_last.pth]
"""
import argparse
import glob
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

import pointops  # from the PointTransformer repo (lib/pointops)

CLASSES = 20
IGNORE_INDEX = 255


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", default="data/scannet_pt")
    p.add_argument("--save_path", default="exp/ptv1")
    p.add_argument("--batch_size", type=int, default=2, help="scenes per GPU")
    p.add_argument("--voxel_size", type=float, default=0.02)
    p.add_argument("--voxel_max", type=int, default=80000)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--base_lr", type=float, default=0.5, help="for 16 scenes per step")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--resume", default="")
    p.add_argument("--manual_seed", type=int, default=7777)
    return p.parse_args()


def voxelize(coord, voxel_size):
    key = np.floor((coord - coord.min(0)) / voxel_size).astype(np.int64)
    _, idx = np.unique(key[:, 0] * 1_000_003 ** 2 + key[:, 1] * 1_000_003 + key[:, 2], return_index=True)
    return idx


class ScanNetPT(Dataset):
    def __init__(self, root, split, voxel_size, voxel_max, train):
        self.files = sorted(glob.glob(os.path.join(root, split, "*.pth")))
        self.voxel_size, self.voxel_max, self.train = voxel_size, voxel_max, train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        coord, color, label = torch.load(self.files[i])   # numpy arrays saved by the preprocessing script
        if self.train:
            theta = np.random.uniform(0, 2 * np.pi)
            c, s = np.cos(theta), np.sin(theta)
            coord = coord @ np.array([[c, s, 0], [-s, c, 0], [0, 0, 1]], dtype=np.float32)
            coord = coord * np.random.uniform(0.9, 1.1)
            if np.random.rand() < 0.5:
                coord[:, 0] = -coord[:, 0]
        keep = voxelize(coord, self.voxel_size)
        if self.train and len(keep) > self.voxel_max:
            center = coord[keep][np.random.randint(len(keep))]
            d = ((coord[keep] - center) ** 2).sum(1)
            keep = keep[np.argsort(d)[: self.voxel_max]]
        coord, color, label = coord[keep], color[keep], label[keep]
        coord = coord - coord.min(0)
        feat = np.concatenate([color / 255.0, coord], 1).astype(np.float32)
        return torch.from_numpy(coord).float(), torch.from_numpy(feat), torch.from_numpy(label).long()


def collate_offset(batch):
    coord, feat, label = zip(*batch)
    offset = torch.cumsum(torch.tensor([c.shape[0] for c in coord]), 0).int()
    return torch.cat(coord), torch.cat(feat), torch.cat(label), offset


class PointTransformerLayer(nn.Module):
    def __init__(self, planes, nsample=16, share=8):
        super().__init__()
        self.nsample, self.share = nsample, share
        self.q, self.k, self.v = nn.Linear(planes, planes), nn.Linear(planes, planes), nn.Linear(planes, planes)
        self.pos = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.ReLU(inplace=True), nn.Linear(3, planes))
        self.attn = nn.Sequential(nn.BatchNorm1d(planes), nn.ReLU(inplace=True), nn.Linear(planes, planes // share),
                                  nn.BatchNorm1d(planes // share), nn.ReLU(inplace=True),
                                  nn.Linear(planes // share, planes // share))

    def forward(self, p, x, o):
        idx, _ = pointops.knn_query(self.nsample, p, o)             # (n, nsample)
        q, k, v = self.q(x), self.k(x)[idx.long()], self.v(x)[idx.long()]
        rel = p[idx.long()] - p.unsqueeze(1)                        # (n, s, 3)
        n, s, _ = rel.shape
        pe = self.pos[3](F.relu(self.pos[1](self.pos[0](rel).view(-1, 3)).view(n, s, 3)))
        w = k - q.unsqueeze(1) + pe
        for i, layer in enumerate(self.attn):
            w = layer(w.transpose(1, 2).contiguous()).transpose(1, 2).contiguous() if isinstance(layer, nn.BatchNorm1d) else layer(w)
        w = F.softmax(w, dim=1)
        c = x.shape[1]
        out = ((v + pe).view(n, s, self.share, c // self.share) * w.unsqueeze(2)).sum(1).view(n, c)
        return out


class PTBlock(nn.Module):
    def __init__(self, planes, nsample):
        super().__init__()
        self.fc1, self.bn1 = nn.Linear(planes, planes, bias=False), nn.BatchNorm1d(planes)
        self.transformer, self.bn2 = PointTransformerLayer(planes, nsample), nn.BatchNorm1d(planes)
        self.fc3, self.bn3 = nn.Linear(planes, planes, bias=False), nn.BatchNorm1d(planes)

    def forward(self, p, x, o):
        identity = x
        x = F.relu(self.bn1(self.fc1(x)))
        x = F.relu(self.bn2(self.transformer(p, x, o)))
        x = self.bn3(self.fc3(x))
        return p, F.relu(x + identity), o


class PointTransformerSegLite(nn.Module):
    """Full-resolution variant (no transition down/up) used for quick ablations."""

    def __init__(self, in_ch=6, planes=64, depth=6, nsample=16, num_classes=CLASSES):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(in_ch, planes, bias=False), nn.BatchNorm1d(planes), nn.ReLU(True))
        self.blocks = nn.ModuleList([PTBlock(planes, nsample) for _ in range(depth)])
        self.cls = nn.Sequential(nn.Linear(planes, planes), nn.BatchNorm1d(planes), nn.ReLU(True),
                                 nn.Linear(planes, num_classes))

    def forward(self, p, x, o):
        x = self.stem(x)
        for blk in self.blocks:
            p, x, o = blk(p, x, o)
        return self.cls(x)


def intersection_and_union(pred, target, k):
    valid = target != IGNORE_INDEX
    pred, target = pred[valid], target[valid]
    inter = torch.histc(pred[pred == target].float(), bins=k, min=0, max=k - 1)
    a_pred = torch.histc(pred.float(), bins=k, min=0, max=k - 1)
    a_tgt = torch.histc(target.float(), bins=k, min=0, max=k - 1)
    return inter, a_pred + a_tgt - inter, a_tgt


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    random.seed(args.manual_seed + rank)
    np.random.seed(args.manual_seed + rank)
    torch.manual_seed(args.manual_seed)

    writer = None
    if rank == 0:
        os.makedirs(os.path.join(args.save_path, "model"), exist_ok=True)
        writer = SummaryWriter(args.save_path)

    model = PointTransformerSegLite()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = DistributedDataParallel(model, device_ids=[local_rank])
    lr = args.base_lr * args.batch_size * world_size / 16
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [int(args.epochs * 0.6), int(args.epochs * 0.8)], 0.1)
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX).cuda()

    start_epoch, best_iou = 0, 0.0
    if args.resume:
        checkpoint = torch.load(args.resume)
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        start_epoch, best_iou = checkpoint["epoch"], checkpoint["best_iou"]
        if rank == 0:
            print(f"=> resumed from {args.resume} (epoch {start_epoch})")

    train_data = ScanNetPT(args.data_root, "train", args.voxel_size, args.voxel_max, train=True)
    val_data = ScanNetPT(args.data_root, "val", args.voxel_size, None, train=False)
    train_sampler = DistributedSampler(train_data)
    train_loader = DataLoader(train_data, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, collate_fn=collate_offset)
    val_loader = DataLoader(torch.utils.data.Subset(val_data, range(rank, len(val_data), world_size)),
                            batch_size=1, num_workers=args.workers, collate_fn=collate_offset)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        end = time.time()
        for i, (coord, feat, target, offset) in enumerate(train_loader):
            coord, feat = coord.cuda(non_blocking=True), feat.cuda(non_blocking=True)
            target, offset = target.cuda(non_blocking=True), offset.cuda(non_blocking=True)
            output = model(coord, feat, offset)
            loss = criterion(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if rank == 0 and (i + 1) % 20 == 0:
                print(f"Epoch [{epoch + 1}/{args.epochs}][{i + 1}/{len(train_loader)}] loss {loss.item():.4f} "
                      f"batch {time.time() - end:.2f}s")
                writer.add_scalar("loss_train_batch", loss.item(), epoch * len(train_loader) + i)
            end = time.time()
        scheduler.step()

        # validation
        model.eval()
        inter_sum = torch.zeros(CLASSES).cuda()
        union_sum = torch.zeros(CLASSES).cuda()
        target_sum = torch.zeros(CLASSES).cuda()
        with torch.no_grad():
            for coord, feat, target, offset in val_loader:
                coord, feat, target, offset = coord.cuda(), feat.cuda(), target.cuda(), offset.cuda()
                output = model.module(coord, feat, offset)
                inter, union, tgt = intersection_and_union(output.argmax(1), target, CLASSES)
                inter_sum += inter
                union_sum += union
                target_sum += tgt
        for t in (inter_sum, union_sum, target_sum):
            dist.all_reduce(t)
        iou = inter_sum / (union_sum + 1e-10)
        miou = iou.mean().item()
        allacc = (inter_sum.sum() / (target_sum.sum() + 1e-10)).item()

        if rank == 0:
            print(f"Val result: mIoU/allAcc {miou:.4f}/{allacc:.4f}")
            writer.add_scalar("mIoU_val", miou, epoch + 1)
            writer.add_scalar("allAcc_val", allacc, epoch + 1)
            is_best = miou > best_iou
            best_iou = max(best_iou, miou)
            state = {"epoch": epoch + 1, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "best_iou": best_iou}
            torch.save(state, os.path.join(args.save_path, "model", "model_last.pth"))
            if is_best:
                torch.save(state, os.path.join(args.save_path, "model", "model_best.pth"))
        dist.barrier()

    if rank == 0:
        writer.close()
        print(f"==> training done, best mIoU {best_iou:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
