"""PointMLP-elite on ScanObjectNN (OBJ_BG, h5 from the official release), DDP.

    torchrun --nproc_per_node=8 main_scanobjectnn.py --variant main_split --batch_size 32 --epochs 200
"""
import argparse
import datetime
import os

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from pointnet2_ops import pointnet2_utils


def parse_args():
    p = argparse.ArgumentParser("PointMLP ScanObjectNN")
    p.add_argument("--data_dir", default="data/h5_files")
    p.add_argument("--variant", default="main_split", choices=["main_split", "main_split_nobg"])
    p.add_argument("--batch_size", type=int, default=32, help="per GPU")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--lr", type=float, default=0.01, help="for 32 samples per step")
    p.add_argument("--num_points", type=int, default=1024)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log_dir", default="runs/pointmlp_sonn")
    return p.parse_args()


class ScanObjectNN(Dataset):
    # OBJ_BG / OBJ_ONLY: 2309 training and 581 test objects, 15 classes
    def __init__(self, data_dir, variant, split, num_points):
        fname = "training_objectdataset.h5" if split == "train" else "test_objectdataset.h5"
        with h5py.File(os.path.join(data_dir, variant, fname), "r") as f:
            self.points = f["data"][:].astype(np.float32)
            self.labels = f["label"][:].astype(np.int64)
        self.num_points, self.train = num_points, split == "train"

    def __len__(self):
        return self.points.shape[0]

    def __getitem__(self, i):
        pts = self.points[i][: self.num_points].copy()
        if self.train:
            np.random.shuffle(pts)
            pts = pts * np.random.uniform(2 / 3, 3 / 2, 3).astype(np.float32) + \
                np.random.uniform(-0.2, 0.2, 3).astype(np.float32)
        return torch.from_numpy(pts), self.labels[i]


def knn_group(xyz, new_xyz, feats, k):
    d = torch.cdist(new_xyz, xyz)
    idx = d.topk(k, dim=-1, largest=False)[1]                      # B, S, k
    b = torch.arange(xyz.shape[0], device=xyz.device).view(-1, 1, 1)
    return feats[b, idx], xyz[b, idx]


class ConvBNReLU1D(nn.Sequential):
    def __init__(self, cin, cout):
        super().__init__(nn.Conv1d(cin, cout, 1, bias=False), nn.BatchNorm1d(cout), nn.ReLU(inplace=True))


class ResBlock1D(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.net = nn.Sequential(ConvBNReLU1D(c, c // 2), nn.Conv1d(c // 2, c, 1, bias=False), nn.BatchNorm1d(c))

    def forward(self, x):
        return F.relu(self.net(x) + x)


class LocalStage(nn.Module):
    def __init__(self, cin, cout, npoint, k):
        super().__init__()
        self.npoint, self.k = npoint, k
        self.alpha = nn.Parameter(torch.ones(1, 1, 1, cin + 3))
        self.beta = nn.Parameter(torch.zeros(1, 1, 1, cin + 3))
        self.transfer = ConvBNReLU1D(2 * cin + 3, cout)
        self.pre = ResBlock1D(cout)
        self.pos = ResBlock1D(cout)

    def forward(self, xyz, feats):                                   # xyz B,N,3  feats B,N,C
        fps = pointnet2_utils.furthest_point_sample(xyz.contiguous(), self.npoint).long()
        bidx = torch.arange(xyz.shape[0], device=xyz.device).view(-1, 1)
        new_xyz, new_feats = xyz[bidx, fps], feats[bidx, fps]
        g_feats, g_xyz = knn_group(xyz, new_xyz, feats, self.k)
        grouped = torch.cat([g_feats, g_xyz], -1)
        mean = torch.cat([new_feats, new_xyz], -1).unsqueeze(2)
        std = (grouped - mean).reshape(xyz.shape[0], -1).std(-1).view(-1, 1, 1, 1)
        grouped = self.alpha * (grouped - mean) / (std + 1e-5) + self.beta
        grouped = torch.cat([grouped, new_feats.unsqueeze(2).expand(-1, -1, self.k, -1)], -1)
        b, s, k, c = grouped.shape
        x = self.pre(self.transfer(grouped.permute(0, 1, 3, 2).reshape(b * s, c, k)))
        x = x.max(-1)[0].view(b, s, -1).transpose(1, 2)
        x = self.pos(x)
        return new_xyz, x.transpose(1, 2)


class PointMLPElite(nn.Module):
    def __init__(self, num_classes=15, dims=(32, 64, 128, 256, 256), points=(512, 256, 128, 64), k=24):
        super().__init__()
        self.embed = ConvBNReLU1D(3, dims[0])
        self.stages = nn.ModuleList([LocalStage(dims[i], dims[i + 1], points[i], k) for i in range(4)])
        self.classifier = nn.Sequential(
            nn.Linear(dims[-1], 512), nn.BatchNorm1d(512), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(512, 256), nn.BatchNorm1d(256), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(256, num_classes))

    def forward(self, xyz):
        feats = self.embed(xyz.transpose(1, 2)).transpose(1, 2)
        for stage in self.stages:
            xyz, feats = stage(xyz, feats)
        return self.classifier(feats.max(1)[0])


def cal_loss(pred, gold, smoothing=0.2):
    n_class = pred.size(1)
    one_hot = F.one_hot(gold, n_class).float()
    one_hot = one_hot * (1 - smoothing) + (1 - one_hot) * smoothing / (n_class - 1)
    return -(one_hot * F.log_softmax(pred, dim=1)).sum(1).mean()


@torch.no_grad()
def validate(model, loader, device, num_classes=15):
    model.eval()
    per_class = torch.zeros(2, num_classes, device=device)       # correct, total
    for pts, label in loader:
        pts, label = pts.to(device), label.to(device)
        pred = model(pts).argmax(1)
        per_class[0].index_add_(0, label, (pred == label).float())
        per_class[1].index_add_(0, label, torch.ones_like(label, dtype=torch.float))
    dist.all_reduce(per_class)
    oa = (per_class[0].sum() / per_class[1].sum()).item()
    macc = (per_class[0] / per_class[1].clamp(min=1)).mean().item()
    return oa, macc


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)

    train_set = ScanObjectNN(args.data_dir, args.variant, "train", args.num_points)
    test_set = ScanObjectNN(args.data_dir, args.variant, "test", args.num_points)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=4,
                              pin_memory=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, range(rank, len(test_set), world)),
                             batch_size=args.batch_size, num_workers=4)

    model = PointMLPElite().to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 32
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=2e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs, eta_min=lr / 100)

    writer = SummaryWriter(args.log_dir) if rank == 0 else None
    best_oa = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        stats = torch.zeros(3, device=device)
        for pts, label in train_loader:
            pts, label = pts.to(device, non_blocking=True), label.to(device, non_blocking=True)
            logits = model(pts)
            loss = cal_loss(logits, label)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10)
            optimizer.step()
            stats += torch.stack([loss.detach() * len(label), (logits.argmax(1) == label).sum().float(),
                                  torch.tensor(float(len(label)), device=device)])
        scheduler.step()
        dist.all_reduce(stats)
        oa, macc = validate(model.module, test_loader, device)
        if rank == 0:
            print(f"Epoch {epoch}: loss {stats[0].item() / stats[2].item():.4f} "
                  f"train OA {stats[1].item() / stats[2].item():.4f} test OA {oa:.4f} mAcc {macc:.4f}", flush=True)
            writer.add_scalar("train/loss", stats[0].item() / stats[2].item(), epoch)
            writer.add_scalar("test/OA", oa, epoch)
            writer.add_scalar("test/mAcc", macc, epoch)
            if oa > best_oa:
                best_oa = oa
                torch.save({"epoch": epoch, "net": model.module.state_dict(), "acc": oa},
                           os.path.join(args.log_dir, "best_checkpoint.pth"))
            torch.save({"epoch": epoch, "net": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                       os.path.join(args.log_dir, "last_checkpoint.pth"))
        dist.barrier()

    if rank == 0:
        print(f"best test OA {best_oa:.4f}")
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
