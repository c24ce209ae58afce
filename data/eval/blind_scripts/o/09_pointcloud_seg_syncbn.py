"""PointNet++ (SSG, pure-torch ops) semantic segmentation on S3DIS blocks.

torchrun --standalone --nproc_per_node=4 09_pointcloud_seg_syncbn.py --data /data/s3dis_blocks --test-area 5
"""
import argparse
import glob
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

NUM_CLASSES = 13


def args_():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/s3dis_blocks")
    ap.add_argument("--test-area", type=int, default=5)
    ap.add_argument("--npoints", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=4, help="per GPU")
    ap.add_argument("--epochs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workdir", default="work_dirs/pn2_s3dis")
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


class S3DISBlocks(Dataset):
    def __init__(self, root, test_area, npoints, train):
        files = sorted(glob.glob(os.path.join(root, "*.npy")))
        keep = (lambda f: f"Area_{test_area}" not in f) if train else (lambda f: f"Area_{test_area}" in f)
        self.files = [f for f in files if keep(f)]
        self.npoints, self.train = npoints, train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        blk = np.load(self.files[i])  # N x 7: xyz rgb label
        n = blk.shape[0]
        choice = np.random.choice(n, self.npoints, replace=n < self.npoints) if self.train else \
            np.resize(np.arange(n), self.npoints)
        blk = blk[choice]
        xyz = blk[:, :3] - blk[:, :3].mean(0)
        if self.train:
            theta = np.random.uniform(0, 2 * np.pi)
            c, s = np.cos(theta), np.sin(theta)
            xyz = xyz @ np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]], dtype=np.float32).T
            xyz *= np.random.uniform(0.9, 1.1)
        feats = np.concatenate([xyz, blk[:, 3:6] / 255.0], 1).astype(np.float32)
        return torch.from_numpy(feats), torch.from_numpy(blk[:, 6].astype(np.int64))


def fps(xyz, m):
    B, N, _ = xyz.shape
    idx = torch.zeros(B, m, dtype=torch.long, device=xyz.device)
    dist_ = torch.full((B, N), 1e10, device=xyz.device)
    far = torch.randint(0, N, (B,), device=xyz.device)
    ar = torch.arange(B, device=xyz.device)
    for i in range(m):
        idx[:, i] = far
        c = xyz[ar, far].unsqueeze(1)
        dist_ = torch.minimum(dist_, ((xyz - c) ** 2).sum(-1))
        far = dist_.argmax(-1)
    return idx


def gather(x, idx):
    return torch.gather(x, 1, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]))


class SetAbstraction(nn.Module):
    def __init__(self, m, k, cin, mlp):
        super().__init__()
        self.m, self.k = m, k
        layers, c = [], cin + 3
        for co in mlp:
            layers += [nn.Conv2d(c, co, 1), nn.BatchNorm2d(co), nn.ReLU(True)]
            c = co
        self.mlp = nn.Sequential(*layers)

    def forward(self, xyz, feat):
        cidx = fps(xyz, self.m)
        new_xyz = gather(xyz, cidx)
        knn = torch.cdist(new_xyz, xyz).topk(self.k, largest=False).indices  # B m k
        B = xyz.shape[0]
        g_xyz = torch.stack([gather(xyz[b:b + 1], knn[b:b + 1].flatten(1)).view(self.m, self.k, 3) for b in range(B)])
        g_xyz = g_xyz - new_xyz.unsqueeze(2)
        g_f = torch.stack([gather(feat[b:b + 1], knn[b:b + 1].flatten(1)).view(self.m, self.k, -1) for b in range(B)])
        x = torch.cat([g_xyz, g_f], -1).permute(0, 3, 1, 2)  # B C m k
        return new_xyz, self.mlp(x).max(-1).values.transpose(1, 2)


class FeaturePropagation(nn.Module):
    def __init__(self, cin, mlp):
        super().__init__()
        layers, c = [], cin
        for co in mlp:
            layers += [nn.Conv1d(c, co, 1), nn.BatchNorm1d(co), nn.ReLU(True)]
            c = co
        self.mlp = nn.Sequential(*layers)

    def forward(self, xyz1, xyz2, f1, f2):
        d, idx = torch.cdist(xyz1, xyz2).topk(3, largest=False)
        w = 1.0 / (d + 1e-8)
        w = w / w.sum(-1, keepdim=True)
        interp = sum(gather(f2, idx[..., j]) * w[..., j:j + 1] for j in range(3))
        x = interp if f1 is None else torch.cat([f1, interp], -1)
        return self.mlp(x.transpose(1, 2)).transpose(1, 2)


class PointNet2Seg(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.sa1 = SetAbstraction(1024, 32, 6, [32, 32, 64])
        self.sa2 = SetAbstraction(256, 32, 64, [64, 64, 128])
        self.sa3 = SetAbstraction(64, 32, 128, [128, 128, 256])
        self.fp3 = FeaturePropagation(128 + 256, [256, 256])
        self.fp2 = FeaturePropagation(64 + 256, [256, 128])
        self.fp1 = FeaturePropagation(6 + 128, [128, 128])
        self.head = nn.Sequential(nn.Conv1d(128, 128, 1), nn.BatchNorm1d(128), nn.ReLU(True), nn.Dropout(0.5),
                                  nn.Conv1d(128, num_classes, 1))

    def forward(self, pts):
        xyz = pts[..., :3].contiguous()
        x1, f1 = self.sa1(xyz, pts)
        x2, f2 = self.sa2(x1, f1)
        x3, f3 = self.sa3(x2, f2)
        f2 = self.fp3(x2, x3, f2, f3)
        f1 = self.fp2(x1, x2, f1, f2)
        f0 = self.fp1(xyz, x1, pts, f1)
        return self.head(f0.transpose(1, 2))  # B C N


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    conf = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long, device=device)
    for pts, lbl in loader:
        pts, lbl = pts.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
        pred = model(pts).argmax(1)
        conf += torch.bincount(lbl.flatten() * NUM_CLASSES + pred.flatten(),
                               minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES)
    dist.all_reduce(conf)
    iou = conf.diag().float() / (conf.sum(0) + conf.sum(1) - conf.diag()).clamp(min=1).float()
    acc = conf.diag().sum().float() / conf.sum().clamp(min=1).float()
    return iou.mean().item(), acc.item()


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    train_set = S3DISBlocks(args.data, args.test_area, args.npoints, train=True)
    val_set = S3DISBlocks(args.data, args.test_area, args.npoints, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=6,
                              pin_memory=True, drop_last=True, worker_init_fn=lambda w: np.random.seed(
                                  (torch.initial_seed() + w) % 2 ** 32))
    val_idx = list(range(rank, len(val_set), world))
    val_loader = DataLoader(torch.utils.data.Subset(val_set, val_idx), batch_size=args.batch_size, num_workers=4)

    model = PointNet2Seg(NUM_CLASSES)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=1e-5)

    ckpt_path = os.path.join(args.workdir, "last.pth")
    start, best_miou = 0, 0.0
    if args.resume and os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, map_location={"cuda:0": f"cuda:{local_rank}"})
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start, best_miou = ck["epoch"] + 1, ck["best_miou"]
        if rank == 0:
            print(f"resumed from epoch {ck['epoch']}")

    if rank == 0:
        os.makedirs(args.workdir, exist_ok=True)

    for epoch in range(start, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, run_loss = time.time(), torch.zeros(2, device=device)
        for it, (pts, lbl) in enumerate(train_loader):
            pts, lbl = pts.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
            loss = F.cross_entropy(model(pts), lbl)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run_loss += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(run_loss)
        miou, acc = validate(model.module, val_loader, device)
        best_miou = max(best_miou, miou)
        if rank == 0:
            print(f"epoch {epoch} loss {(run_loss[0] / run_loss[1]).item():.4f} val mIoU {miou:.4f} "
                  f"oAcc {acc:.4f} best {best_miou:.4f} time {time.time() - t0:.0f}s", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best_miou": best_miou}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if miou >= best_miou:
                torch.save(model.module.state_dict(), os.path.join(args.workdir, "best_model.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
