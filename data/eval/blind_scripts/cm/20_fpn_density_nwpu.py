"""
Density-map crowd counting on NWPU-Crowd with a ResNet-50 + FPN regressor.

Targets: geometry-adaptive Gaussians (sigma = 0.3 * mean distance to the 3
nearest heads, clipped) rendered on the stride-4 output grid inside the
dataset.  Validation reports MAE / MSE / NAE over the full val split.

    torchrun --nproc_per_node=8 20_fpn_density_nwpu.py --root /datasets/NWPU-Crowd --out runs/fpn_nwpu
"""
import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from scipy.spatial import cKDTree
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.models import ResNet50_Weights
from torchvision.models.detection.backbone_utils import resnet_fpn_backbone

STRIDE = 4


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="runs/fpn_nwpu")
    ap.add_argument("--crop", type=int, default=512)
    ap.add_argument("--max-size", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def adaptive_density(points, h, w):
    oh, ow = h // STRIDE, w // STRIDE
    den = np.zeros((oh, ow), np.float32)
    if len(points) == 0:
        return den
    if len(points) > 3:
        d, _ = cKDTree(points).query(points, k=4)
        sigmas = np.clip(0.3 * d[:, 1:].mean(1), 2.0, 40.0)
    else:
        sigmas = np.full(len(points), 15.0)
    ys = (np.arange(oh, dtype=np.float32) + 0.5) * STRIDE
    xs = (np.arange(ow, dtype=np.float32) + 0.5) * STRIDE
    for (x, y), s in zip(points, sigmas):
        r = 3 * s
        x0, x1 = np.searchsorted(xs, x - r), np.searchsorted(xs, x + r)
        y0, y1 = np.searchsorted(ys, y - r), np.searchsorted(ys, y + r)
        if x1 <= x0 or y1 <= y0:
            continue
        k = np.exp(-((ys[y0:y1, None] - y) ** 2 + (xs[None, x0:x1] - x) ** 2) / (2 * s * s))
        den[y0:y1, x0:x1] += k / k.sum()
    return den


class NWPU(Dataset):
    def __init__(self, root, split, crop, max_size, train):
        with open(os.path.join(root, f"{split}.txt")) as f:
            self.ids = [line.split()[0] for line in f if line.strip()]
        self.root, self.crop, self.max_size, self.train = root, crop, max_size, train
        self.norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, "images", self.ids[i] + ".jpg")).convert("RGB")
        with open(os.path.join(self.root, "jsons", self.ids[i] + ".json")) as f:
            pts = np.array(json.load(f)["points"], np.float32).reshape(-1, 2)
        w, h = img.size
        r = min(1.0, self.max_size / max(w, h))
        if self.train:
            r *= random.uniform(0.8, 1.2)
            r = max(r, (self.crop + 32) / min(w, h))
        nw, nh = int(w * r) // 32 * 32, int(h * r) // 32 * 32
        img = img.resize((nw, nh), Image.BILINEAR)
        pts = pts * [nw / w, nh / h]
        if self.train:
            x0, y0 = random.randint(0, nw - self.crop), random.randint(0, nh - self.crop)
            img = img.crop((x0, y0, x0 + self.crop, y0 + self.crop))
            pts = pts - [x0, y0]
            pts = pts[(pts[:, 0] >= 0) & (pts[:, 0] < self.crop) & (pts[:, 1] >= 0) & (pts[:, 1] < self.crop)]
            nw = nh = self.crop
            if random.random() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
                pts[:, 0] = nw - pts[:, 0]
        x = self.norm(transforms.functional.to_tensor(img))
        den = torch.from_numpy(adaptive_density(pts, nh, nw))[None]
        return x, den, float(len(pts))


class EvalShard(Sampler):
    """indices[rank::world] without the padding DistributedSampler would add"""

    def __init__(self, n, rank, world):
        self.ids = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.ids)

    def __len__(self):
        return len(self.ids)


class FPNCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fpn = resnet_fpn_backbone(backbone_name="resnet50", weights=ResNet50_Weights.IMAGENET1K_V2,
                                       trainable_layers=5, returned_layers=[1, 2, 3, 4])
        self.head = nn.Sequential(
            nn.Conv2d(256 * 4, 256, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 128, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(128, 1, 1), nn.Softplus())

    def forward(self, x):
        feats = self.fpn(x)
        p2 = feats["0"]
        ups = [p2] + [F.interpolate(feats[k], size=p2.shape[-2:], mode="bilinear", align_corners=False)
                      for k in ("1", "2", "3")]
        return self.head(torch.cat(ups, 1))


@torch.no_grad()
def evaluate(net, loader):
    net.eval()
    abs_err = sq_err = rel_err = 0.0
    n = 0
    for x, _, gt in loader:
        pred = net(x.cuda(non_blocking=True)).sum().item()
        g = float(gt)
        abs_err += abs(pred - g)
        sq_err += (pred - g) ** 2
        rel_err += abs(pred - g) / g if g > 0 else 0.0
        n += 1
    stats = torch.tensor([abs_err, sq_err, rel_err, n], dtype=torch.float64)
    dist.all_reduce(stats)
    return (stats[0] / stats[3]).item(), (stats[1] / stats[3]).sqrt().item(), (stats[2] / stats[3]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    train_set = NWPU(args.root, "train", args.crop, args.max_size, True)
    val_set = NWPU(args.root, "val", args.crop, args.max_size, False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, 1, sampler=EvalShard(len(val_set), rank, world), num_workers=4)

    net = FPNCounter().cuda()
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs, eta_min=1e-7)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (x, den, _) in enumerate(train_loader):
            x, den = x.cuda(non_blocking=True), den.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                pred = model(x)
            pred = pred.float()
            loss = F.mse_loss(pred, den * 100.0) + 0.01 * F.l1_loss(pred.sum((1, 2, 3)) / 100.0, den.sum((1, 2, 3)))
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f}", flush=True)
        scheduler.step()

        if (epoch + 1) % args.eval_every == 0:
            mae, mse, nae = evaluate(_Scaled(net), val_loader)
            if rank == 0:
                print(f"ep {epoch}: MAE {mae:.2f} MSE {mse:.2f} NAE {nae:.4f} ({time.time() - t0:.0f}s)", flush=True)
                torch.save({"model": net.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pth"))
                if mae < best:
                    best = mae
                    torch.save({"model": net.state_dict(), "epoch": epoch, "mae": mae},
                               os.path.join(args.out, "best.pth"))
            dist.barrier()

    dist.destroy_process_group()


class _Scaled(nn.Module):
    """the network is trained on density x 100; undo it for counting"""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x) / 100.0


if __name__ == "__main__":
    main()
