"""
68-point face alignment on 300W (HRNet csv annotations), one process per GPU
started with torch.multiprocessing.spawn.  Evaluation uses flip test and
reports inter-ocular NME on the common / challenging / full test sets.

    CUDA_VISIBLE_DEVICES=0,1,2,3 python 18_300w_r18.py --root data/300w --out output/300w_r18
"""
import argparse
import csv
import os
import socket
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

# mirror index for the 68-point markup
FLIP_68 = (list(range(16, -1, -1)) + list(range(26, 16, -1)) + [27, 28, 29, 30] + [35, 34, 33, 32, 31]
           + [45, 44, 43, 42, 47, 46, 39, 38, 37, 36, 41, 40]
           + [54, 53, 52, 51, 50, 49, 48, 59, 58, 57, 56, 55] + [64, 63, 62, 61, 60, 67, 66, 65])


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/300w")
    p.add_argument("--out", default="output/300w_r18")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--sigma", type=float, default=1.5)
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Face300W(Dataset):
    def __init__(self, root, csv_name, train, inp=256, out=64, sigma=1.5):
        with open(os.path.join(root, csv_name)) as f:
            rows = list(csv.reader(f))[1:]
        self.root, self.train, self.inp, self.out, self.sigma = root, train, inp, out, sigma
        self.items = [(r[0], float(r[1]), np.array(r[2:4], np.float32), np.array(r[4:], np.float32).reshape(68, 2))
                      for r in rows]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        name, scale, center, pts = self.items[idx]
        img = cv2.cvtColor(cv2.imread(os.path.join(self.root, "images", name)), cv2.COLOR_BGR2RGB)
        pts, center = pts.copy(), center.copy()
        side = scale * 200 * 1.25
        rot = 0.0
        if self.train:
            side *= np.random.uniform(0.75, 1.25)
            rot = np.random.uniform(-30, 30) if np.random.rand() < 0.6 else 0.0
            if np.random.rand() < 0.5:
                img = img[:, ::-1].copy()
                pts[:, 0] = img.shape[1] - 1 - pts[:, 0]
                center[0] = img.shape[1] - 1 - center[0]
                pts = pts[FLIP_68]
        M = cv2.getRotationMatrix2D((float(center[0]), float(center[1])), rot, self.inp / side)
        M[:, 2] += self.inp / 2 - center
        crop = cv2.warpAffine(img, M, (self.inp, self.inp))
        pts = (np.c_[pts, np.ones(68)] @ M.T).astype(np.float32)
        g = np.arange(self.out, dtype=np.float32)
        p = pts * self.out / self.inp
        hm = np.exp(-((g[None, None] - p[:, 0, None, None]) ** 2 + (g[None, :, None] - p[:, 1, None, None]) ** 2)
                    / (2 * self.sigma ** 2)).astype(np.float32)
        x = torch.from_numpy(crop).permute(2, 0, 1).float().div(255.0)
        x = torchvision.transforms.functional.normalize(x, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        return x, torch.from_numpy(hm), torch.from_numpy(pts), idx


class FaceNet(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet18(weights="IMAGENET1K_V1")
        self.body = nn.Sequential(*list(r.children())[:-2])
        layers, ch = [], 512
        for _ in range(3):
            layers += [nn.ConvTranspose2d(ch, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True)]
            ch = 256
        self.up = nn.Sequential(*layers)
        self.out = nn.Conv2d(256, 68, 1)

    def forward(self, x):
        return self.out(self.up(self.body(x)))


def decode(hm):
    b, k, h, w = hm.shape
    i = hm.flatten(2).argmax(-1)
    x, y = (i % w).float(), (i // w).float()
    xi, yi = x.long().clamp(1, w - 2), y.long().clamp(1, h - 2)
    bi, ki = torch.meshgrid(torch.arange(b, device=hm.device), torch.arange(k, device=hm.device), indexing="ij")
    dx = hm[bi, ki, yi, xi + 1] - hm[bi, ki, yi, xi - 1]
    dy = hm[bi, ki, yi + 1, xi] - hm[bi, ki, yi - 1, xi]
    return torch.stack([x + 0.25 * dx.sign(), y + 0.25 * dy.sign()], -1)


@torch.no_grad()
def evaluate(net, loader, world_size, stride):
    net.eval()
    idxs, nmes = [], []
    for x, _, pts, idx in loader:
        x = x.cuda(non_blocking=True)
        hm = net(x)
        hm_f = net(x.flip(3)).flip(3)[:, FLIP_68]
        pred = decode((hm + hm_f) / 2) * stride
        pts = pts.cuda()
        iod = torch.linalg.norm(pts[:, 36] - pts[:, 45], dim=-1)
        nmes.append(torch.linalg.norm(pred - pts, dim=-1).mean(-1) / iod)
        idxs.append(idx.cuda())
    nmes, idxs = torch.cat(nmes), torch.cat(idxs)
    all_n = [torch.empty_like(nmes) for _ in range(world_size)]
    all_i = [torch.empty_like(idxs) for _ in range(world_size)]
    dist.all_gather(all_n, nmes)
    dist.all_gather(all_i, idxs)
    per_sample = torch.zeros(len(loader.dataset), device=nmes.device)
    per_sample[torch.cat(all_i)] = torch.cat(all_n)   # duplicates from sampler padding overwrite themselves
    return per_sample


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    torch.manual_seed(0)

    train_set = Face300W(args.root, "face_landmarks_300w_train.csv", True, sigma=args.sigma)
    test_sets = {name: Face300W(args.root, f"face_landmarks_300w_valid_{name}.csv", False, sigma=args.sigma)
                 for name in ("common", "challenge")}
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)
    test_loaders = {k: DataLoader(v, 32, sampler=DistributedSampler(v, world_size, rank, shuffle=False),
                                  num_workers=args.workers) for k, v in test_sets.items()}

    net = FaceNet().cuda(rank)
    model = DDP(net, device_ids=[rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [30, 50], 0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, hm, _, _ in loader:
            x, hm = x.cuda(rank, non_blocking=True), hm.cuda(rank, non_blocking=True)
            loss = F.mse_loss(model(x), hm)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        scheduler.step()

        res = {k: evaluate(net, dl, world_size, 4.0) for k, dl in test_loaders.items()}
        full = torch.cat([res["common"], res["challenge"]]).mean().item()
        if rank == 0:
            msg = " ".join(f"{k} {v.mean().item() * 100:.2f}" for k, v in res.items())
            print(f"epoch {epoch} loss {loss.item():.5f} NME(%) {msg} full {full * 100:.2f} "
                  f"[{time.time() - t0:.0f}s]", flush=True)
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pth"))
            if full < best:
                best = full
                torch.save(net.state_dict(), os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    args = get_args()
    world_size = torch.cuda.device_count()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
