"""
EAST text detector (ResNet-50 U-Net trunk, RBOX geometry) on ICDAR2015 + ICDAR2013 + MLT-latin.
Score / geometry maps are precomputed at 1/4 resolution by tools/east_gt.py:
    <root>/<split>/<name>.jpg  and  <root>/<split>/<name>_east.npz  (score, geo[5], mask)

    torchrun --nproc_per_node=4 16_east_r50_icdar.py --root /data/east_maps --epochs 600
"""
import argparse
import os
import time

import cv2
import lanms
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import resnet50

parser = argparse.ArgumentParser(description="EAST training")
parser.add_argument("--root", required=True)
parser.add_argument("--input-size", type=int, default=512)
parser.add_argument("--batch-size", type=int, default=12)
parser.add_argument("--epochs", type=int, default=600)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--workers", type=int, default=8)
parser.add_argument("--save-interval", type=int, default=10)
parser.add_argument("--ckpt-dir", default="./ckpt/east_r50")
parser.add_argument("--local_rank", type=int, default=0)


class EASTMaps(Dataset):
    def __init__(self, root, split, size, train=True):
        self.dir = os.path.join(root, split)
        self.names = sorted(n[:-4] for n in os.listdir(self.dir) if n.endswith(".jpg"))
        self.size, self.train = size, train

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        name = self.names[i]
        img = cv2.imread(os.path.join(self.dir, name + ".jpg"))
        m = np.load(os.path.join(self.dir, name + "_east.npz"))
        score, geo, mask = m["score"], m["geo"], m["mask"]
        s = self.size
        # random crop of the (already rescaled) image and the matching 1/4 window in the maps
        H, W = img.shape[:2]
        if self.train and H > s and W > s:
            y0 = np.random.randint(0, (H - s) // 4 + 1) * 4
            x0 = np.random.randint(0, (W - s) // 4 + 1) * 4
        else:
            y0 = x0 = 0
        img = img[y0:y0 + s, x0:x0 + s]
        q = s // 4
        score = score[y0 // 4:y0 // 4 + q, x0 // 4:x0 // 4 + q]
        geo = geo[:, y0 // 4:y0 // 4 + q, x0 // 4:x0 // 4 + q]
        mask = mask[y0 // 4:y0 // 4 + q, x0 // 4:x0 // 4 + q]
        img = cv2.copyMakeBorder(img, 0, s - img.shape[0], 0, s - img.shape[1], cv2.BORDER_CONSTANT)
        pad = lambda a: np.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, q - a.shape[-2]), (0, q - a.shape[-1])])
        x = torch.from_numpy(img[:, :, ::-1].astype(np.float32) / 255.0).permute(2, 0, 1)
        x = (x - 0.5) / 0.5
        return x, torch.from_numpy(pad(score)).float()[None], torch.from_numpy(pad(geo)).float(), \
            torch.from_numpy(pad(mask)).float()[None]


class UpBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.c1 = nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(True))
        self.c3 = nn.Sequential(nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(True))

    def forward(self, x, skip):
        x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=False)
        return self.c3(self.c1(torch.cat([x, skip], 1)))


class EAST(nn.Module):
    def __init__(self, text_scale=512):
        super().__init__()
        r = resnet50(weights="IMAGENET1K_V2")
        self.l1 = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1)  # /4, 256
        self.l2, self.l3, self.l4 = r.layer2, r.layer3, r.layer4                # /8 /16 /32
        self.u3 = UpBlock(2048 + 1024, 128)
        self.u2 = UpBlock(128 + 512, 64)
        self.u1 = UpBlock(64 + 256, 32)
        self.out = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(True))
        self.score = nn.Conv2d(32, 1, 1)
        self.dist = nn.Conv2d(32, 4, 1)
        self.angle = nn.Conv2d(32, 1, 1)
        self.text_scale = text_scale

    def forward(self, x):
        c1 = self.l1(x); c2 = self.l2(c1); c3 = self.l3(c2); c4 = self.l4(c3)
        h = self.out(self.u1(self.u2(self.u3(c4, c3), c2), c1))
        score = torch.sigmoid(self.score(h))
        d = torch.sigmoid(self.dist(h)) * self.text_scale
        ang = (torch.sigmoid(self.angle(h)) - 0.5) * np.pi / 2
        return score, torch.cat([d, ang], 1)


def east_loss(score_p, geo_p, score_g, geo_g, mask):
    inter = (score_p * score_g * mask).sum()
    dice = 1 - 2 * inter / ((score_p * mask).sum() + (score_g * mask).sum() + 1e-5)
    t_g, r_g, b_g, l_g, a_g = geo_g.split(1, 1)
    t_p, r_p, b_p, l_p, a_p = geo_p.split(1, 1)
    area_g = (t_g + b_g) * (r_g + l_g)
    area_p = (t_p + b_p) * (r_p + l_p)
    w_i = torch.min(r_g, r_p) + torch.min(l_g, l_p)
    h_i = torch.min(t_g, t_p) + torch.min(b_g, b_p)
    a_i = w_i * h_i
    l_aabb = -torch.log((a_i + 1) / (area_g + area_p - a_i + 1))
    l_theta = 1 - torch.cos(a_p - a_g)
    l_geo = l_aabb + 20 * l_theta
    return dice + (l_geo * score_g * mask).sum() / (score_g * mask).sum().clamp(min=1)


def restore_rboxes(score, geo, thr=0.9):
    ys, xs = np.where(score > thr)
    boxes = []
    for y, x in zip(ys, xs):
        t, r, b, l, a = geo[:, y, x]
        cx, cy = x * 4.0, y * 4.0
        rect = ((cx + (r - l) / 2 * np.cos(a), cy + (b - t) / 2), (l + r, t + b), np.degrees(a))
        pts = cv2.boxPoints(rect).reshape(-1)
        boxes.append(np.append(pts, score[y, x]))
    if not boxes:
        return np.zeros((0, 9), np.float32)
    return lanms.merge_quadrangle_n9(np.array(boxes, np.float32), 0.2)


def main():
    args = parser.parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    train_ds = EASTMaps(args.root, "train", args.input_size, train=True)
    sampler = DistributedSampler(train_ds)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    model = EAST(args.input_size)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[args.epochs // 2], gamma=0.1)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"world size {world}, {len(train_ds)} training images, {len(loader)} iters/epoch", flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(1, device=device)
        for i, (img, score_g, geo_g, mask) in enumerate(loader):
            img, score_g = img.cuda(non_blocking=True), score_g.cuda(non_blocking=True)
            geo_g, mask = geo_g.cuda(non_blocking=True), mask.cuda(non_blocking=True)
            score_p, geo_p = model(img)
            loss = east_loss(score_p, geo_p, score_g, geo_g, mask)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
        scheduler.step()
        dist.all_reduce(loss_sum)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {loss_sum.item() / (world * len(loader)):.4f} "
                  f"time {time.time() - t0:.1f}s", flush=True)
            if (epoch + 1) % args.save_interval == 0:
                torch.save({"epoch": epoch, "state_dict": model.module.state_dict(),
                            "optimizer": optimizer.state_dict()},
                           os.path.join(args.ckpt_dir, f"east_epoch_{epoch + 1}.pth"))

    if rank == 0:
        # quick sanity check of the decoder on one training image
        model.module.eval()
        with torch.no_grad():
            img, _, _, _ = train_ds[0]
            s, g = model.module(img[None].cuda())
            boxes = restore_rboxes(s[0, 0].cpu().numpy(), g[0].cpu().numpy())
        print(f"sanity: {len(boxes)} boxes on {train_ds.names[0]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
