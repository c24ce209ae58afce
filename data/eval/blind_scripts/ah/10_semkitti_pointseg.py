"""Point-based semantic segmentation on SemanticKITTI (19 classes), PointNet++-style set abstraction in plain PyTorch.

    torchrun --nproc_per_node=4 train_semkitti.py --root /datasets/SemanticKITTI/dataset --npoints 40000
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

IGNORE = 255
TRAIN_SEQS = ["00", "01", "02", "03", "04", "05", "06", "07", "09", "10"]
VAL_SEQS = ["08"]


class SemanticKITTI(Dataset):
    def __init__(self, root, seqs, label_cfg, npoints, train):
        with open(label_cfg) as f:
            cfg = yaml.safe_load(f)
        lut = np.full(max(cfg["learning_map"].keys()) + 100, IGNORE, np.int64)
        for k, v in cfg["learning_map"].items():
            lut[k] = v - 1 if v > 0 else IGNORE  # 0 = unlabeled
        self.lut = lut
        self.files = []
        for s in seqs:
            vdir = os.path.join(root, "sequences", s, "velodyne")
            self.files += [os.path.join(vdir, f) for f in sorted(os.listdir(vdir))]
        self.npoints, self.train = npoints, train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        scan = np.fromfile(self.files[i], np.float32).reshape(-1, 4)
        lab_file = self.files[i].replace("velodyne", "labels").replace(".bin", ".label")
        sem = np.fromfile(lab_file, np.uint32) & 0xFFFF
        labels = self.lut[sem]
        if self.train:
            theta = np.random.uniform(0, 2 * np.pi)
            c, s = np.cos(theta), np.sin(theta)
            scan[:, :2] = scan[:, :2] @ np.array([[c, s], [-s, c]], np.float32)
            scan[:, :3] *= np.random.uniform(0.95, 1.05)
            if np.random.rand() < 0.5:
                scan[:, 1] = -scan[:, 1]
            # random 50m x 50m crop around a random point to bound memory
            ctr = scan[np.random.randint(len(scan)), :2]
            keep = np.all(np.abs(scan[:, :2] - ctr) < 25.0, axis=1)
            scan, labels = scan[keep], labels[keep]
        choice = np.random.choice(len(scan), self.npoints, replace=len(scan) < self.npoints)
        return torch.from_numpy(scan[choice]), torch.from_numpy(labels[choice])


def knn_group(xyz, new_xyz, feats, k):
    d = torch.cdist(new_xyz, xyz)
    idx = d.topk(k, largest=False).indices  # B, M, k
    B = xyz.shape[0]
    bidx = torch.arange(B, device=xyz.device)[:, None, None]
    rel = xyz[bidx, idx] - new_xyz[:, :, None]
    grouped = torch.cat([rel, feats[bidx, idx]], -1) if feats is not None else rel
    return grouped


class SetAbstraction(nn.Module):
    def __init__(self, npoint, k, cin, mlp):
        super().__init__()
        self.npoint, self.k = npoint, k
        layers, c = [], cin + 3
        for m in mlp:
            layers += [nn.Conv2d(c, m, 1, bias=False), nn.BatchNorm2d(m), nn.ReLU(True)]
            c = m
        self.mlp = nn.Sequential(*layers)

    def forward(self, xyz, feats):
        B, N, _ = xyz.shape
        sel = torch.stack([torch.randperm(N, device=xyz.device)[:self.npoint] for _ in range(B)])
        new_xyz = torch.gather(xyz, 1, sel[..., None].expand(-1, -1, 3))
        g = knn_group(xyz, new_xyz, feats, self.k).permute(0, 3, 1, 2)
        return new_xyz, self.mlp(g).max(-1).values.transpose(1, 2)


class FeaturePropagation(nn.Module):
    def __init__(self, cin, mlp):
        super().__init__()
        layers, c = [], cin
        for m in mlp:
            layers += [nn.Conv1d(c, m, 1, bias=False), nn.BatchNorm1d(m), nn.ReLU(True)]
            c = m
        self.mlp = nn.Sequential(*layers)

    def forward(self, xyz1, xyz2, f1, f2):
        d, idx = torch.cdist(xyz1, xyz2).topk(3, largest=False)
        w = 1.0 / (d + 1e-8)
        w = w / w.sum(-1, keepdim=True)
        bidx = torch.arange(xyz1.shape[0], device=xyz1.device)[:, None, None]
        interp = (f2[bidx, idx] * w[..., None]).sum(2)
        x = torch.cat([interp, f1], -1) if f1 is not None else interp
        return self.mlp(x.transpose(1, 2)).transpose(1, 2)


class PointNet2Seg(nn.Module):
    def __init__(self, num_classes=19):
        super().__init__()
        self.sa1 = SetAbstraction(4096, 16, 1, [32, 32, 64])
        self.sa2 = SetAbstraction(1024, 16, 64, [64, 64, 128])
        self.sa3 = SetAbstraction(256, 16, 128, [128, 128, 256])
        self.sa4 = SetAbstraction(64, 16, 256, [256, 256, 512])
        self.fp4 = FeaturePropagation(768, [256, 256])
        self.fp3 = FeaturePropagation(384, [256, 256])
        self.fp2 = FeaturePropagation(320, [256, 128])
        self.fp1 = FeaturePropagation(129, [128, 128, 128])
        self.cls = nn.Sequential(nn.Conv1d(128, 128, 1, bias=False), nn.BatchNorm1d(128), nn.ReLU(True),
                                 nn.Dropout(0.5), nn.Conv1d(128, num_classes, 1))

    def forward(self, pts):
        xyz, f0 = pts[..., :3].contiguous(), pts[..., 3:]
        x1, f1 = self.sa1(xyz, f0)
        x2, f2 = self.sa2(x1, f1)
        x3, f3 = self.sa3(x2, f2)
        x4, f4 = self.sa4(x3, f3)
        f3 = self.fp4(x3, x4, f3, f4)
        f2 = self.fp3(x2, x3, f2, f3)
        f1 = self.fp2(x1, x2, f1, f2)
        f0 = self.fp1(xyz, x1, f0, f1)
        return self.cls(f0.transpose(1, 2))  # B, C, N


def class_weights(root, label_cfg, num_classes=19):
    with open(label_cfg) as f:
        cfg = yaml.safe_load(f)
    freq = np.zeros(num_classes)
    for k, v in cfg["content"].items():
        m = cfg["learning_map"][k]
        if m > 0:
            freq[m - 1] += v
    return torch.tensor(1.0 / np.sqrt(freq + 1e-3), dtype=torch.float32)


@torch.no_grad()
def evaluate(model, loader, device, num_classes=19):
    model.eval()
    conf = torch.zeros(num_classes, num_classes, dtype=torch.long, device=device)
    for pts, lab in loader:
        pts, lab = pts.to(device, non_blocking=True), lab.to(device, non_blocking=True)
        pred = model(pts).argmax(1)
        m = lab != IGNORE
        conf += torch.bincount(lab[m] * num_classes + pred[m], minlength=num_classes ** 2).view(num_classes, -1)
    dist.all_reduce(conf)
    tp = conf.diag().float()
    iou = tp / (conf.sum(0) + conf.sum(1) - conf.diag()).float().clamp(min=1)
    model.train()
    return iou.mean().item(), iou.cpu().numpy()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--label_cfg", default="config/semantic-kitti.yaml")
    p.add_argument("--npoints", type=int, default=40000)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=0.002)
    p.add_argument("--out", default="logs/pn2_semkitti")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)

    train_ds = SemanticKITTI(args.root, TRAIN_SEQS, args.label_cfg, args.npoints, True)
    val_ds = SemanticKITTI(args.root, VAL_SEQS, args.label_cfg, args.npoints, False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=6, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, list(range(rank, len(val_ds), world))),
                        args.batch_size, num_workers=6)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(PointNet2Seg()).to(device)
    model = DDP(model, device_ids=[local_rank])
    criterion = nn.CrossEntropyLoss(weight=class_weights(args.root, args.label_cfg).to(device),
                                    ignore_index=IGNORE)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs * len(train_dl), eta_min=1e-5)

    start_epoch, best_miou = 0, 0.0
    ckpt_file = os.path.join(args.out, "last.pth")
    if args.resume and os.path.isfile(ckpt_file):
        ck = torch.load(ckpt_file, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best_miou = ck["epoch"] + 1, ck["best_miou"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic, seen = time.time(), 0
        for it, (pts, lab) in enumerate(train_dl):
            pts, lab = pts.to(device, non_blocking=True), lab.to(device, non_blocking=True)
            if (lab != IGNORE).sum() == 0:
                continue
            logits = model(pts)
            loss = criterion(logits, lab)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            seen += pts.shape[0]
            if rank == 0 and it % 50 == 0:
                print(f"ep {epoch} it {it}/{len(train_dl)} loss {loss.item():.4f} "
                      f"{seen * world / (time.time() - tic):.1f} scans/s", flush=True)

        miou, ious = evaluate(model.module, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} val mIoU {miou:.4f} | " + " ".join(f"{x:.3f}" for x in ious), flush=True)
            best_miou = max(best_miou, miou)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best_miou": best_miou}, ckpt_file)
            if miou == best_miou:
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
