#!/usr/bin/env python
# SuperPoint joint detector/descriptor training on COCO with homographic-adaptation pseudo labels.
# Usage:
#   torchrun --nproc_per_node=4 04_superpoint_coco_joint.py --coco /data/coco/train2017 \
#       --labels /data/coco/sp_pseudo_labels --save_dir checkpoints/superpoint_coco
import argparse
import glob
import os
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

parser = argparse.ArgumentParser(description="SuperPoint training")
parser.add_argument("--coco", required=True)
parser.add_argument("--labels", required=True)
parser.add_argument("--save_dir", default="checkpoints/superpoint")
parser.add_argument("--height", type=int, default=240)
parser.add_argument("--width", type=int, default=320)
parser.add_argument("--batch_size", type=int, default=16)
parser.add_argument("--lr", type=float, default=1e-4)
parser.add_argument("--iterations", type=int, default=200000)
parser.add_argument("--lambda_d", type=float, default=250.0)
parser.add_argument("--lambda_loss", type=float, default=1e-4)
parser.add_argument("--workers", type=int, default=8)
parser.add_argument("--local_rank", type=int, default=0)
parser.add_argument("--seed", type=int, default=0)


def sample_homography(h, w, rng, perspective=0.1, scale=(0.8, 1.2), rot=np.pi / 6, trans=0.1):
    src = np.array([[0, 0], [w, 0], [w, h], [0, h]], np.float32)
    dst = src.copy()
    dst += rng.uniform(-perspective, perspective, (4, 2)).astype(np.float32) * [w, h]
    c = dst.mean(0)
    s = rng.uniform(*scale)
    a = rng.uniform(-rot, rot)
    R = np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]], np.float32)
    dst = (dst - c) @ R.T * s + c
    dst += rng.uniform(-trans, trans, 2).astype(np.float32) * [w, h]
    return cv2.getPerspectiveTransform(src, dst.astype(np.float32))


class CocoPseudoLabels(Dataset):
    def __init__(self, img_dir, label_dir, size):
        self.labels = sorted(glob.glob(os.path.join(label_dir, "*.npz")))
        self.img_dir = img_dir
        self.h, self.w = size

    def __len__(self):
        return len(self.labels)

    def _heatmap(self, pts):
        hm = np.zeros((self.h, self.w), np.float32)
        p = np.round(pts).astype(int)
        ok = (p[:, 0] >= 0) & (p[:, 0] < self.w) & (p[:, 1] >= 0) & (p[:, 1] < self.h)
        hm[p[ok, 1], p[ok, 0]] = 1.0
        return hm

    def __getitem__(self, i):
        rng = np.random.default_rng()
        lab = np.load(self.labels[i])
        name = os.path.splitext(os.path.basename(self.labels[i]))[0]
        img = cv2.imread(os.path.join(self.img_dir, name + ".jpg"), cv2.IMREAD_GRAYSCALE)
        sx, sy = self.w / img.shape[1], self.h / img.shape[0]
        img = cv2.resize(img, (self.w, self.h), interpolation=cv2.INTER_AREA).astype(np.float32) / 255.0
        pts = lab["points"][:, :2] * [sx, sy]
        H = sample_homography(self.h, self.w, rng)
        warped = cv2.warpPerspective(img, H, (self.w, self.h))
        valid = cv2.warpPerspective(np.ones_like(img), H, (self.w, self.h), flags=cv2.INTER_NEAREST)
        wpts = cv2.perspectiveTransform(pts[None].astype(np.float32), H)[0] if len(pts) else pts
        # photometric jitter on both views
        img = np.clip(img * rng.uniform(0.7, 1.3) + rng.normal(0, 0.02, img.shape), 0, 1).astype(np.float32)
        warped = np.clip(warped * rng.uniform(0.7, 1.3) + rng.normal(0, 0.02, img.shape), 0, 1).astype(np.float32)
        return {
            "image": torch.from_numpy(img)[None], "warped": torch.from_numpy(warped)[None],
            "heatmap": torch.from_numpy(self._heatmap(pts)), "wheatmap": torch.from_numpy(self._heatmap(wpts)),
            "valid": torch.from_numpy(valid), "H": torch.from_numpy(H.astype(np.float32)),
        }


def conv_bn(cin, cout, k=3):
    return nn.Sequential(nn.Conv2d(cin, cout, k, padding=k // 2), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class SuperPoint(nn.Module):
    def __init__(self, desc_dim=256):
        super().__init__()
        c = [64, 64, 128, 128]
        self.encoder = nn.Sequential(
            conv_bn(1, c[0]), conv_bn(c[0], c[0]), nn.MaxPool2d(2),
            conv_bn(c[0], c[1]), conv_bn(c[1], c[1]), nn.MaxPool2d(2),
            conv_bn(c[1], c[2]), conv_bn(c[2], c[2]), nn.MaxPool2d(2),
            conv_bn(c[2], c[3]), conv_bn(c[3], c[3]),
        )
        self.det = nn.Sequential(conv_bn(c[3], 256), nn.Conv2d(256, 65, 1))
        self.desc = nn.Sequential(conv_bn(c[3], 256), nn.Conv2d(256, desc_dim, 1))

    def forward(self, x):
        f = self.encoder(x)
        return self.det(f), F.normalize(self.desc(f), dim=1)


def detector_loss(logits, heatmap, valid):
    b, _, hc, wc = logits.shape
    labels = F.pixel_unshuffle(heatmap[:, None], 8)  # b x 64 x hc x wc
    # one label per cell: random keypoint among those present, dustbin otherwise
    labels = torch.cat([labels * 2, torch.ones(b, 1, hc, wc, device=labels.device)], 1)
    labels = (labels + torch.rand_like(labels) * 0.1).argmax(1)
    vmask = F.pixel_unshuffle(valid[:, None], 8).min(1).values
    loss = F.cross_entropy(logits, labels, reduction="none")
    return (loss * vmask).sum() / vmask.sum().clamp(min=1)


def descriptor_loss(d0, d1, H, valid, lambda_d, pos_m=1.0, neg_m=0.2, cell=8):
    b, c, hc, wc = d0.shape
    ys, xs = torch.meshgrid(torch.arange(hc, device=d0.device), torch.arange(wc, device=d0.device), indexing="ij")
    centers = torch.stack([xs, ys], -1).float().reshape(-1, 2) * cell + cell // 2
    ones = torch.ones(centers.size(0), 1, device=d0.device)
    warped = torch.cat([centers, ones], 1) @ H.transpose(1, 2)
    warped = warped[..., :2] / warped[..., 2:]
    s = (torch.cdist(warped, centers[None].expand(b, -1, -1)) <= cell - 0.5).float()
    dot = torch.einsum("bci,bcj->bij", d0.flatten(2), d1.flatten(2))
    pos = lambda_d * s * (pos_m - dot).clamp(min=0)
    neg = (1 - s) * (dot - neg_m).clamp(min=0)
    vmask = F.pixel_unshuffle(valid[:, None], cell).min(1).values.flatten(1)[:, None]
    return ((pos + neg) * vmask).sum() / (vmask.sum() * hc * wc).clamp(min=1)


def main():
    args = parser.parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)

    dataset = CocoPseudoLabels(args.coco, args.labels, (args.height, args.width))
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    net = SuperPoint().cuda(args.local_rank)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    net = DistributedDataParallel(net, device_ids=[args.local_rank])
    optimizer = torch.optim.Adam(net.parameters(), lr=args.lr, betas=(0.9, 0.999))

    writer = None
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.save_dir, "logs"))
        print(f"{len(dataset)} images, {world_size} processes, batch {args.batch_size}/gpu")

    it, epoch = 0, 0
    tic = time.time()
    while it < args.iterations:
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.cuda(args.local_rank, non_blocking=True) for k, v in batch.items()}
            imgs = torch.cat([batch["image"], batch["warped"]], 0)
            logits, desc = net(imgs)
            b = batch["image"].size(0)
            valid0 = torch.ones_like(batch["valid"])
            l_det = detector_loss(logits[:b], batch["heatmap"], valid0) + \
                detector_loss(logits[b:], batch["wheatmap"], batch["valid"])
            l_desc = descriptor_loss(desc[:b], desc[b:], batch["H"], batch["valid"], args.lambda_d)
            loss = l_det + args.lambda_loss * l_desc
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

            if it % 100 == 0:
                logs = torch.stack([loss.detach(), l_det.detach(), l_desc.detach()])
                dist.all_reduce(logs)
                logs /= world_size
                if rank == 0:
                    for name, v in zip(("loss", "det", "desc"), logs.tolist()):
                        writer.add_scalar(f"train/{name}", v, it)
                    print(f"[{it:>7d}] loss {logs[0]:.4f} det {logs[1]:.4f} desc {logs[2]:.4f} "
                          f"{(time.time() - tic) / 100:.3f}s/it", flush=True)
                    tic = time.time()
            if it % 5000 == 0 and rank == 0:
                torch.save({"model_state_dict": net.module.state_dict(),
                            "optimizer_state_dict": optimizer.state_dict(), "n_iter": it},
                           os.path.join(args.save_dir, f"superpoint_{it}.pth.tar"))
            it += 1
            if it >= args.iterations:
                break
        epoch += 1

    if rank == 0:
        torch.save({"model_state_dict": net.module.state_dict(), "n_iter": it},
                   os.path.join(args.save_dir, "superpoint_final.pth.tar"))
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
