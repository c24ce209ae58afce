"""
PointNet++ (SSG) part segmentation on ShapeNetPart, pure-PyTorch FPS / ball query.

    torchrun --nproc_per_node=4 09_pointnet2_partseg.py --root data/shapenetcore_partanno_segmentation_benchmark_v0_normal

训练 200 epoch, 每 5 个 epoch 在 test split 上算 instance mIoU。
"""
import argparse
import json
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

NUM_CLASSES, NUM_PARTS = 16, 50


class ShapeNetPart(Dataset):
    def __init__(self, root, split, npoints=2048, augment=False):
        with open(os.path.join(root, "synsetoffset2category.txt")) as f:
            cats = [l.split() for l in f]
        self.cat2idx = {c[1]: i for i, c in enumerate(sorted(cats, key=lambda c: c[0]))}
        with open(os.path.join(root, "train_test_split", f"shuffled_{split}_file_list.json")) as f:
            names = json.load(f)
        self.files = [(n.split("/")[1], os.path.join(root, n.split("/")[1], n.split("/")[2] + ".txt")) for n in names]
        self.npoints, self.augment = npoints, augment

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        cat, path = self.files[i]
        data = np.loadtxt(path).astype(np.float32)
        choice = np.random.choice(len(data), self.npoints, replace=len(data) < self.npoints)
        pts, seg = data[choice, :6], data[choice, -1].astype(np.int64)
        pts[:, :3] -= pts[:, :3].mean(0)
        pts[:, :3] /= np.linalg.norm(pts[:, :3], axis=1).max()
        if self.augment:
            pts[:, :3] *= np.random.uniform(0.8, 1.25, 3)
            pts[:, :3] += np.random.uniform(-0.1, 0.1, 3)
        return {"points": torch.from_numpy(pts), "seg": torch.from_numpy(seg),
                "cls": torch.tensor(self.cat2idx[cat])}


def move_to_device(batch, device="cuda:0"):
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def farthest_point_sample(xyz, npoint):
    B, N, _ = xyz.shape
    idx = torch.zeros(B, npoint, dtype=torch.long, device=xyz.device)
    dist_ = torch.full((B, N), 1e10, device=xyz.device)
    far = torch.randint(0, N, (B,), device=xyz.device)
    bidx = torch.arange(B, device=xyz.device)
    for i in range(npoint):
        idx[:, i] = far
        c = xyz[bidx, far].unsqueeze(1)
        dist_ = torch.minimum(dist_, ((xyz - c) ** 2).sum(-1))
        far = dist_.argmax(-1)
    return idx


def gather(points, idx):
    B = points.shape[0]
    bidx = torch.arange(B, device=points.device).view(B, *([1] * (idx.dim() - 1)))
    return points[bidx, idx]


def ball_query(radius, k, xyz, new_xyz):
    d = torch.cdist(new_xyz, xyz)                              # B, S, N
    d[d > radius] = float("inf")
    knn = d.topk(k, dim=-1, largest=False)
    idx = knn.indices
    first = idx[:, :, :1].expand_as(idx)
    return torch.where(torch.isinf(knn.values), first, idx)


class SetAbstraction(nn.Module):
    def __init__(self, npoint, radius, k, cin, mlp):
        super().__init__()
        self.npoint, self.radius, self.k = npoint, radius, k
        layers, c = [], cin + 3
        for m in mlp:
            layers += [nn.Conv2d(c, m, 1), nn.BatchNorm2d(m), nn.ReLU(True)]
            c = m
        self.mlp = nn.Sequential(*layers)

    def forward(self, xyz, feat):
        if self.npoint is None:                                   # group all
            new_xyz = xyz.mean(1, keepdim=True)
            grouped = torch.cat([xyz - new_xyz, feat], -1).unsqueeze(1)
        else:
            new_xyz = gather(xyz, farthest_point_sample(xyz, self.npoint))
            idx = ball_query(self.radius, self.k, xyz, new_xyz)
            grouped = torch.cat([gather(xyz, idx) - new_xyz.unsqueeze(2), gather(feat, idx)], -1)
        out = self.mlp(grouped.permute(0, 3, 2, 1)).max(2)[0]      # B, C, S
        return new_xyz, out.transpose(1, 2)


class FeaturePropagation(nn.Module):
    def __init__(self, cin, mlp):
        super().__init__()
        layers, c = [], cin
        for m in mlp:
            layers += [nn.Conv1d(c, m, 1), nn.BatchNorm1d(m), nn.ReLU(True)]
            c = m
        self.mlp = nn.Sequential(*layers)

    def forward(self, xyz1, xyz2, f1, f2):
        if xyz2.shape[1] == 1:
            interp = f2.expand(-1, xyz1.shape[1], -1)
        else:
            d, idx = torch.cdist(xyz1, xyz2).topk(3, dim=-1, largest=False)
            w = 1.0 / (d + 1e-8)
            w = w / w.sum(-1, keepdim=True)
            interp = (gather(f2, idx) * w.unsqueeze(-1)).sum(2)
        x = torch.cat([f1, interp], -1) if f1 is not None else interp
        return self.mlp(x.transpose(1, 2)).transpose(1, 2)


class PointNet2PartSeg(nn.Module):
    def __init__(self):
        super().__init__()
        self.sa1 = SetAbstraction(512, 0.2, 32, 3, [64, 64, 128])
        self.sa2 = SetAbstraction(128, 0.4, 64, 128, [128, 128, 256])
        self.sa3 = SetAbstraction(None, None, None, 256, [256, 512, 1024])
        self.fp3 = FeaturePropagation(1280, [256, 256])
        self.fp2 = FeaturePropagation(384, [256, 128])
        self.fp1 = FeaturePropagation(128 + 16 + 6, [128, 128, 128])
        self.head = nn.Sequential(nn.Conv1d(128, 128, 1), nn.BatchNorm1d(128), nn.ReLU(True),
                                  nn.Dropout(0.5), nn.Conv1d(128, NUM_PARTS, 1))

    def forward(self, points, cls):
        xyz, nrm = points[..., :3], points[..., 3:]
        l1_xyz, l1 = self.sa1(xyz, nrm)
        l2_xyz, l2 = self.sa2(l1_xyz, l1)
        l3_xyz, l3 = self.sa3(l2_xyz, l2)
        l2 = self.fp3(l2_xyz, l3_xyz, l2, l3)
        l1 = self.fp2(l1_xyz, l2_xyz, l1, l2)
        onehot = F.one_hot(cls, NUM_CLASSES).float().unsqueeze(1).expand(-1, xyz.shape[1], -1)
        l0 = self.fp1(xyz, l1_xyz, torch.cat([onehot, points], -1), l1)
        return self.head(l0.transpose(1, 2))                           # B, 50, N


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    iou_sum = torch.zeros((), device=device, dtype=torch.float64)
    n_shapes = torch.zeros((), device=device, dtype=torch.float64)
    for batch in loader:
        batch = move_to_device(batch)
        pred = model(batch["points"], batch["cls"]).argmax(1)
        for p, g in zip(pred, batch["seg"]):
            parts = torch.unique(g)
            ious = [((p == c) & (g == c)).sum() / ((p == c) | (g == c)).sum().clamp(min=1) for c in parts]
            iou_sum += torch.stack(ious).mean().double()
            n_shapes += 1
    dist.all_reduce(iou_sum)
    dist.all_reduce(n_shapes)
    return (iou_sum / n_shapes).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="log/pointnet2_partseg")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = ShapeNetPart(args.root, "train", augment=True)
    test_ds = ShapeNetPart(args.root, "test")
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    train_dl = DataLoader(train_ds, args.bs, sampler=train_sampler, num_workers=8, drop_last=True, pin_memory=True)
    test_dl = DataLoader(test_ds, args.bs, sampler=test_sampler, num_workers=8)

    model = PointNet2PartSeg().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        stats = torch.zeros(3, device=device)            # loss, correct, total
        for batch in train_dl:
            batch = move_to_device(batch)
            logits = model(batch["points"], batch["cls"])
            loss = F.cross_entropy(logits, batch["seg"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats += torch.stack([loss.detach(), (logits.argmax(1) == batch["seg"]).sum().float(),
                                  torch.tensor(float(batch["seg"].numel()), device=device)])
        sched.step()
        dist.all_reduce(stats)
        if rank == 0:
            # loss 是所有 rank 的平均
            print(f"epoch {epoch:3d} loss {stats[0] / (world * len(train_dl)):.4f} "
                  f"acc {stats[1] / stats[2]:.4f}", flush=True)

        if (epoch + 1) % 5 == 0:
            miou = evaluate(model, test_dl, device)
            if rank == 0:
                print(f"  instance mIoU {miou:.4f}", flush=True)
                if miou > best:
                    best = miou
                    os.makedirs(args.out, exist_ok=True)
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best_model.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
