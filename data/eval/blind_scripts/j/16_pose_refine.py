# SimpleBaseline-style 2D human pose (MPII) + a heatmap refinement stage switched on later in training
# torchrun --nproc_per_node=4 16_pose_refine.py --epochs 140 --refine_start 90
import os
import json
import math
import time
import argparse
import random

import cv2
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import torchvision
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP

NUM_JOINTS = 16
FLIP_PAIRS = [(0, 5), (1, 4), (2, 3), (10, 15), (11, 14), (12, 13)]

parser = argparse.ArgumentParser()
parser.add_argument('--root', default='data/mpii')
parser.add_argument('--input_size', type=int, nargs=2, default=[256, 256])
parser.add_argument('--heatmap_size', type=int, nargs=2, default=[64, 64])
parser.add_argument('--sigma', type=float, default=2.0)
parser.add_argument('--batch_size', type=int, default=32)
parser.add_argument('--epochs', type=int, default=140)
parser.add_argument('--lr', type=float, default=1e-3)
parser.add_argument('--lr_steps', type=int, nargs='+', default=[90, 120])
parser.add_argument('--refine_start', type=int, default=90, help='epoch at which the refine stage is trained')
parser.add_argument('--workers', type=int, default=8)
parser.add_argument('--out', default='output/mpii_res50_refine')
args = parser.parse_args()


class MPIIDataset(Dataset):
    def __init__(self, root, split, train):
        with open(os.path.join(root, 'annot', split + '.json')) as f:
            self.db = json.load(f)
        self.img_dir = os.path.join(root, 'images')
        self.train = train
        self.w, self.h = args.input_size
        self.hw, self.hh = args.heatmap_size

    def __len__(self):
        return len(self.db)

    def __getitem__(self, i):
        a = self.db[i]
        img = cv2.imread(os.path.join(self.img_dir, a['image']))[:, :, ::-1]
        joints = np.array(a['joints'], dtype=np.float32)
        vis = np.array(a['joints_vis'], dtype=np.float32)
        c, s = np.array(a['center'], dtype=np.float32), a['scale'] * 1.25
        r = 0
        if self.train:
            s *= np.clip(np.random.randn() * 0.25 + 1, 0.75, 1.25)
            r = np.clip(np.random.randn() * 30, -60, 60) if random.random() <= 0.6 else 0
            if random.random() < 0.5:
                img = img[:, ::-1]
                joints[:, 0] = img.shape[1] - 1 - joints[:, 0]
                c[0] = img.shape[1] - 1 - c[0]
                for p, q in FLIP_PAIRS:
                    joints[[p, q]], vis[[p, q]] = joints[[q, p]], vis[[q, p]]
        M = cv2.getRotationMatrix2D((float(c[0]), float(c[1])), r, self.w / (s * 200))
        M[:, 2] += np.array([self.w / 2, self.h / 2]) - c
        inp = cv2.warpAffine(np.ascontiguousarray(img), M, (self.w, self.h), flags=cv2.INTER_LINEAR)
        joints = np.concatenate([joints, np.ones((NUM_JOINTS, 1))], 1) @ M.T
        target = np.zeros((NUM_JOINTS, self.hh, self.hw), dtype=np.float32)
        stride = self.w / self.hw
        xs, ys = np.arange(self.hw), np.arange(self.hh)[:, None]
        for j in range(NUM_JOINTS):
            mx, my = joints[j] / stride
            if vis[j] > 0 and 0 <= mx < self.hw and 0 <= my < self.hh:
                target[j] = np.exp(-((xs - mx) ** 2 + (ys - my) ** 2) / (2 * args.sigma ** 2))
            else:
                vis[j] = 0
        inp = (inp.astype(np.float32) / 255. - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]
        return (torch.from_numpy(inp.transpose(2, 0, 1)).float(), torch.from_numpy(target),
                torch.from_numpy(vis), torch.tensor(a['headsize'], dtype=torch.float32),
                torch.from_numpy((joints / stride).astype(np.float32)))


class PoseResNetRefine(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet50(weights='IMAGENET1K_V2')
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        layers, c = [], 2048
        for _ in range(3):
            layers += [nn.ConvTranspose2d(c, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True)]
            c = 256
        self.deconv = nn.Sequential(*layers)
        self.final = nn.Conv2d(256, NUM_JOINTS, 1)
        self.refine = nn.Sequential(nn.Conv2d(256 + NUM_JOINTS, 128, 3, padding=1), nn.BatchNorm2d(128),
                                    nn.ReLU(True), nn.Conv2d(128, 128, 3, padding=1), nn.BatchNorm2d(128),
                                    nn.ReLU(True), nn.Conv2d(128, NUM_JOINTS, 1))

    def forward(self, x, use_refine=True):
        f = self.deconv(self.backbone(x))
        hm = self.final(f)
        if not use_refine:
            return [hm]
        return [hm, hm + self.refine(torch.cat([f, hm], 1))]


def joints_mse(outputs, target, vis):
    w = vis[:, :, None, None]
    return sum(0.5 * ((o * w - target * w) ** 2).mean() for o in outputs) / len(outputs)


def get_max_preds(hm):
    b, j, h, w = hm.shape
    idx = hm.view(b, j, -1).argmax(-1)
    return torch.stack([idx % w, idx // w], -1).float()


@torch.no_grad()
def validate(model, loader, device, use_refine):
    model.eval()
    hits = torch.zeros(2, device=device)
    for img, _, vis, headsize, gt in loader:
        img, vis, headsize, gt = img.to(device), vis.to(device), headsize.to(device), gt.to(device)
        hm = model(img, use_refine)[-1]
        pred = get_max_preds(hm)
        d = (pred - gt).norm(dim=-1) * (args.input_size[0] / args.heatmap_size[0]) / (0.6 * headsize[:, None])
        ok = (d <= 0.5).float() * vis
        hits += torch.stack([ok.sum(), vis.sum()])
    dist.all_reduce(hits)
    return (hits[0] / hits[1]).item()


def main():
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)
    torch.backends.cudnn.benchmark = True

    train_ds = MPIIDataset(args.root, 'train', True)
    val_ds = MPIIDataset(args.root, 'valid', False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), 64,
                            num_workers=4, pin_memory=True)

    model = PoseResNetRefine()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(optimizer, args.lr_steps, 0.1)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        use_refine = epoch >= args.refine_start
        t0, run = time.time(), torch.zeros(2, device=device)
        for i, (img, target, vis, _, _) in enumerate(train_loader):
            img, target, vis = img.to(device, non_blocking=True), target.to(device), vis.to(device)
            outputs = model(img, use_refine)
            loss = joints_mse(outputs, target, vis)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
            if i % 100 == 0 and rank == 0:
                print('ep %d [%d/%d] loss %.6f' % (epoch, i, len(train_loader), loss.item()), flush=True)
        sched.step()
        dist.all_reduce(run)
        pckh = validate(model.module, val_loader, device, use_refine)
        if rank == 0:
            print('epoch %d loss %.6f PCKh@0.5 %.2f refine=%s (%.0fs)' % (epoch, run[0] / run[1], 100 * pckh,
                                                                          use_refine, time.time() - t0))
            torch.save({'epoch': epoch, 'state_dict': model.module.state_dict(), 'perf': pckh},
                       os.path.join(args.out, 'checkpoint.pth'))
            if pckh > best:
                best = pckh
                torch.save(model.module.state_dict(), os.path.join(args.out, 'model_best.pth'))
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
