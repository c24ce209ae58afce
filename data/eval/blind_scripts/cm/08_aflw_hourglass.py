"""
2-stack hourglass for 19-point facial landmarks on AFLW (full split), DDP.

Annotations: csv files from HRNet-Facial-Landmark-Detection
(image_name, scale, center_w, center_h, x1, y1, ..., x19, y19).

Run:
    torchrun --nproc_per_node 4 08_aflw_hourglass.py --data-dir data/aflw --work-dir work/aflw_hg2
"""
import argparse
import csv
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

NUM_PTS = 19


class AFLW(Dataset):
    def __init__(self, data_dir, csv_name, train, inp=256, out=64, sigma=1.0):
        self.data_dir, self.train, self.inp, self.out, self.sigma = data_dir, train, inp, out, sigma
        with open(os.path.join(data_dir, csv_name)) as f:
            rows = list(csv.reader(f))[1:]
        self.items = [(r[0], float(r[1]), np.array(r[2:4], np.float32),
                       np.array(r[4:4 + 2 * NUM_PTS], np.float32).reshape(NUM_PTS, 2)) for r in rows]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        name, scale, center, pts = self.items[idx]
        img = Image.open(os.path.join(self.data_dir, "images", name)).convert("RGB")
        face_size = 200.0 * scale
        scale = scale * 1.25
        rot = 0.0
        if self.train:
            scale *= np.random.uniform(0.75, 1.25)
            rot = np.random.uniform(-30, 30) if np.random.rand() < 0.6 else 0.0
        size = 200.0 * scale
        a = np.deg2rad(rot)
        # similarity transform: image -> crop of side `inp`
        s = self.inp / size
        R = np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]], np.float32) * s
        t = np.array([self.inp / 2, self.inp / 2], np.float32) - R @ center
        Minv = np.linalg.inv(np.vstack([np.hstack([R, t[:, None]]), [0, 0, 1]]))[:2]
        crop = img.transform((self.inp, self.inp), Image.AFFINE, tuple(Minv.reshape(-1)), resample=Image.BILINEAR)
        pts_c = pts @ R.T + t
        x = torch.from_numpy(np.asarray(crop, np.float32) / 255.0).permute(2, 0, 1)
        x = (x - 0.5) / 0.25
        stride = self.inp / self.out
        g = np.arange(self.out, dtype=np.float32)
        hm = np.zeros((NUM_PTS, self.out, self.out), np.float32)
        for j, (px, py) in enumerate(pts_c / stride):
            if 0 <= px < self.out and 0 <= py < self.out:
                hm[j] = np.exp(-((g[None] - px) ** 2 + (g[:, None] - py) ** 2) / (2 * self.sigma ** 2))
        return x, torch.from_numpy(hm), torch.from_numpy(pts_c.astype(np.float32)), \
            torch.tensor(face_size * s, dtype=torch.float32)


class Residual(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        mid = cout // 2
        self.body = nn.Sequential(
            nn.BatchNorm2d(cin), nn.ReLU(inplace=True), nn.Conv2d(cin, mid, 1),
            nn.BatchNorm2d(mid), nn.ReLU(inplace=True), nn.Conv2d(mid, mid, 3, padding=1),
            nn.BatchNorm2d(mid), nn.ReLU(inplace=True), nn.Conv2d(mid, cout, 1))
        self.skip = nn.Identity() if cin == cout else nn.Conv2d(cin, cout, 1)

    def forward(self, x):
        return self.body(x) + self.skip(x)


class Hourglass(nn.Module):
    def __init__(self, depth, ch):
        super().__init__()
        self.up1 = Residual(ch, ch)
        self.low1 = Residual(ch, ch)
        self.low2 = Hourglass(depth - 1, ch) if depth > 1 else Residual(ch, ch)
        self.low3 = Residual(ch, ch)

    def forward(self, x):
        low = self.low3(self.low2(self.low1(F.max_pool2d(x, 2))))
        return self.up1(x) + F.interpolate(low, scale_factor=2, mode="nearest")


class StackedHourglass(nn.Module):
    def __init__(self, nstack=2, ch=256, nout=NUM_PTS):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                                  Residual(64, 128), nn.MaxPool2d(2), Residual(128, 128), Residual(128, ch))
        self.hgs = nn.ModuleList([Hourglass(4, ch) for _ in range(nstack)])
        self.feats = nn.ModuleList([nn.Sequential(Residual(ch, ch), nn.Conv2d(ch, ch, 1), nn.BatchNorm2d(ch),
                                                  nn.ReLU(inplace=True)) for _ in range(nstack)])
        self.outs = nn.ModuleList([nn.Conv2d(ch, nout, 1) for _ in range(nstack)])
        self.merge_feat = nn.ModuleList([nn.Conv2d(ch, ch, 1) for _ in range(nstack - 1)])
        self.merge_pred = nn.ModuleList([nn.Conv2d(nout, ch, 1) for _ in range(nstack - 1)])

    def forward(self, x):
        x = self.stem(x)
        preds = []
        for i, hg in enumerate(self.hgs):
            f = self.feats[i](hg(x))
            p = self.outs[i](f)
            preds.append(p)
            if i < len(self.hgs) - 1:
                x = x + self.merge_feat[i](f) + self.merge_pred[i](p)
        return preds


def decode(hm, stride):
    n, k, h, w = hm.shape
    idx = hm.flatten(2).argmax(-1)
    return torch.stack([idx % w, idx // w], -1).float() * stride + stride / 2 - 0.5


@torch.no_grad()
def evaluate(model, loader, n_total, world_size):
    model.eval()
    nmes = []
    for x, _, pts, norm in loader:
        pred = decode(model(x.cuda(non_blocking=True))[-1], 4.0)
        err = torch.linalg.norm(pred - pts.cuda(), dim=-1).mean(-1)
        nmes.append(err / norm.cuda())
    nmes = torch.cat(nmes)
    out = torch.empty(world_size * nmes.numel(), device=nmes.device)
    dist.all_gather_into_tensor(out, nmes)
    # rank r holds samples r, r+W, r+2W, ... -> restore dataset order and drop sampler padding
    nmes = out.view(world_size, -1).t().reshape(-1)[:n_total]
    return nmes.mean().item(), (nmes < 0.07).float().mean().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default="data/aflw")
    ap.add_argument("--work-dir", default="work/aflw_hg2")
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--lr", type=float, default=2.5e-4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    train_ds = AFLW(args.data_dir, "face_landmarks_aflw_train.csv", train=True)
    test_ds = AFLW(args.data_dir, "face_landmarks_aflw_test.csv", train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(test_ds, batch_size=64, sampler=DistributedSampler(test_ds, shuffle=False),
                             num_workers=4, pin_memory=True)

    model = StackedHourglass().cuda()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.RMSprop(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [30, 50], 0.1)

    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
    best = float("inf")
    for epoch in range(args.epochs):
        model.train()
        tic = time.time()
        for it, (x, hm, _, _) in enumerate(train_loader):
            x, hm = x.cuda(non_blocking=True), hm.cuda(non_blocking=True)
            preds = model(x)
            loss = sum(F.mse_loss(p, hm) for p in preds)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if rank == 0 and it % 50 == 0:
                print(f"ep {epoch} it {it}/{len(train_loader)} loss {loss.item():.6f}", flush=True)
        scheduler.step()

        nme, auc_proxy = evaluate(model, test_loader, len(test_ds), world)
        if rank == 0:
            print(f"ep {epoch} NME {nme * 100:.3f}% acc@0.07 {auc_proxy:.4f} ({time.time() - tic:.0f}s)", flush=True)
            state = {"epoch": epoch, "state_dict": model.module.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(state, os.path.join(args.work_dir, "latest.pth"))
            if nme < best:
                best = nme
                torch.save(state, os.path.join(args.work_dir, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
