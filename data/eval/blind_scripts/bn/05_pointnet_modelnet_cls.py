#!/usr/bin/env python
"""PointNet classification on ModelNet40 (1024 pts, normals optional), multi-GPU.

We hold out 10% of the official train split for model selection and only touch the
official test split once at the end.

  torchrun --nproc_per_node=4 pointnet_cls.py --data data/modelnet40_normal_resampled --use_normals
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, random_split
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_parser():
    p = argparse.ArgumentParser("PointNet")
    p.add_argument("--data", default="data/modelnet40_normal_resampled")
    p.add_argument("--num_point", type=int, default=1024)
    p.add_argument("--use_normals", action="store_true")
    p.add_argument("--batch_size", type=int, default=32, help="per process")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--val_ratio", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log_dir", default="log/pointnet_cls")
    return p


class ModelNet40(Dataset):
    def __init__(self, root, split, num_point, use_normals):
        self.classes = [l.strip() for l in open(os.path.join(root, "modelnet40_shape_names.txt"))]
        self.cls_to_idx = {c: i for i, c in enumerate(self.classes)}
        ids = [l.strip() for l in open(os.path.join(root, f"modelnet40_{split}.txt"))]
        self.items = [(os.path.join(root, "_".join(s.split("_")[:-1]), s + ".txt"),
                       self.cls_to_idx["_".join(s.split("_")[:-1])]) for s in ids]
        self.num_point, self.use_normals = num_point, use_normals

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        pts = np.loadtxt(path, delimiter=",", dtype=np.float32)[: self.num_point]
        pts[:, :3] -= pts[:, :3].mean(0)
        pts[:, :3] /= np.linalg.norm(pts[:, :3], axis=1).max()
        if not self.use_normals:
            pts = pts[:, :3]
        return torch.from_numpy(pts), label


def augment(points):
    # points: B, N, C (on GPU)
    scale = torch.empty(points.shape[0], 1, 3, device=points.device).uniform_(0.8, 1.25)
    shift = torch.empty(points.shape[0], 1, 3, device=points.device).uniform_(-0.1, 0.1)
    xyz = points[..., :3] * scale + shift
    return torch.cat([xyz, points[..., 3:]], -1)


class STN(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.k = k
        self.convs = nn.Sequential(nn.Conv1d(k, 64, 1), nn.BatchNorm1d(64), nn.ReLU(),
                                   nn.Conv1d(64, 128, 1), nn.BatchNorm1d(128), nn.ReLU(),
                                   nn.Conv1d(128, 1024, 1), nn.BatchNorm1d(1024), nn.ReLU())
        self.fc = nn.Sequential(nn.Linear(1024, 512), nn.BatchNorm1d(512), nn.ReLU(),
                                nn.Linear(512, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, k * k))
        nn.init.zeros_(self.fc[-1].weight)
        nn.init.zeros_(self.fc[-1].bias)

    def forward(self, x):
        t = self.fc(self.convs(x).max(-1)[0])
        return t.view(-1, self.k, self.k) + torch.eye(self.k, device=x.device)


class PointNetCls(nn.Module):
    def __init__(self, in_ch=3, num_classes=40):
        super().__init__()
        self.stn = STN(3)
        self.conv1 = nn.Sequential(nn.Conv1d(in_ch, 64, 1), nn.BatchNorm1d(64), nn.ReLU())
        self.fstn = STN(64)
        self.conv2 = nn.Sequential(nn.Conv1d(64, 128, 1), nn.BatchNorm1d(128), nn.ReLU(),
                                   nn.Conv1d(128, 1024, 1), nn.BatchNorm1d(1024))
        self.head = nn.Sequential(nn.Linear(1024, 512), nn.BatchNorm1d(512), nn.ReLU(),
                                  nn.Linear(512, 256), nn.BatchNorm1d(256), nn.ReLU(),
                                  nn.Dropout(0.4), nn.Linear(256, num_classes))

    def forward(self, x):                         # x: B, C, N
        trans = self.stn(x[:, :3])
        xyz = torch.bmm(trans, x[:, :3])
        x = torch.cat([xyz, x[:, 3:]], 1)
        x = self.conv1(x)
        trans_feat = self.fstn(x)
        x = torch.bmm(trans_feat, x)
        x = self.conv2(x).max(-1)[0]
        return self.head(x), trans_feat


def feature_transform_reg(trans):
    eye = torch.eye(trans.shape[1], device=trans.device)[None]
    return torch.mean(torch.norm(torch.bmm(trans, trans.transpose(2, 1)) - eye, dim=(1, 2)))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(2, device=device)
    for pts, label in loader:
        pts, label = pts.to(device), label.to(device)
        logits, _ = model(pts.transpose(1, 2))
        stats[0] += (logits.argmax(1) == label).sum()
        stats[1] += label.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # per-rank seeds so the augmentation noise is not identical on every GPU
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    in_ch = 6 if args.use_normals else 3
    full_train = ModelNet40(args.data, "train", args.num_point, args.use_normals)
    test_set = ModelNet40(args.data, "test", args.num_point, args.use_normals)
    n_val = int(len(full_train) * args.val_ratio)
    train_set, val_set = random_split(full_train, [len(full_train) - n_val, n_val])

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, drop_last=True, pin_memory=True)
    # val/test: rank r takes every world-th shape, no padding
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=64, num_workers=4)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, range(rank, len(test_set), world)),
                             batch_size=64, num_workers=4)

    model = PointNetCls(in_ch, 40)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world, betas=(0.9, 0.999), weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.7)

    writer = SummaryWriter(args.log_dir) if rank == 0 else None
    ckpt_path = os.path.join(args.log_dir, "best_model.pth")
    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(3, device=device)
        for pts, label in train_loader:
            pts, label = pts.to(device, non_blocking=True), label.to(device, non_blocking=True)
            pts = augment(pts)
            logits, trans_feat = model(pts.transpose(1, 2))
            loss = F.cross_entropy(logits, label, label_smoothing=0.1) + 0.001 * feature_transform_reg(trans_feat)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            tot += torch.stack([loss.detach() * label.numel(), (logits.argmax(1) == label).sum().float(),
                                torch.tensor(float(label.numel()), device=device)])
        scheduler.step()
        dist.all_reduce(tot)

        val_acc = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"Epoch {epoch:3d} loss {tot[0].item() / tot[2].item():.4f} train acc {tot[1].item() / tot[2].item():.4f}"
                  f" val acc {val_acc:.4f} ({time.time() - t0:.0f}s)")
            writer.add_scalar("loss/train", tot[0].item() / tot[2].item(), epoch)
            writer.add_scalar("acc/val", val_acc, epoch)
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save({"epoch": epoch, "model_state_dict": model.module.state_dict(), "val_acc": val_acc},
                           ckpt_path)
        dist.barrier()

    # final test with the selected model
    state = torch.load(ckpt_path, map_location=device)
    model.module.load_state_dict(state["model_state_dict"])
    test_acc = evaluate(model.module, test_loader, device)
    if rank == 0:
        print(f"best epoch {state['epoch']} val acc {state['val_acc']:.4f} test acc {test_acc:.4f}")
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
