"""
Context-aware crowd counting (CAN-style, VGG16-BN frontend) on JHU-Crowd++.

Runs are long (~24h on 8 GPUs), so the job is usually restarted from the last
checkpoint by the cluster scheduler:

    torchrun --nproc_per_node=8 11_can_jhu.py --data /data/jhu_crowd_v2.0 \
        --exp exp/can_jhu --resume exp/can_jhu/checkpoint.pth.tar
"""
import argparse
import os
import random
import shutil
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
from torch.utils.tensorboard import SummaryWriter
from torchvision import models, transforms

parser = argparse.ArgumentParser(description="CAN on JHU-Crowd++")
parser.add_argument("--data", required=True)
parser.add_argument("--exp", default="exp/can_jhu")
parser.add_argument("--resume", default="", type=str)
parser.add_argument("--epochs", default=300, type=int)
parser.add_argument("--batch-size", default=8, type=int)
parser.add_argument("--crop", default=400, type=int)
parser.add_argument("--lr", default=1e-4, type=float)
parser.add_argument("--sigma", default=4.0, type=float)
parser.add_argument("--workers", default=6, type=int)
parser.add_argument("--print-freq", default=50, type=int)


def load_points(txt_path):
    # JHU gt: x y w h occlusion blur, one head per line
    if os.path.getsize(txt_path) == 0:
        return np.zeros((0, 2), np.float32)
    return np.loadtxt(txt_path, ndmin=2)[:, :2].astype(np.float32)


def points_to_density(points, h, w, sigma, stride=8):
    """Gaussian target on the stride-8 grid; each head contributes exactly 1."""
    oh, ow = h // stride, w // stride
    ys, xs = np.arange(oh, dtype=np.float32) + 0.5, np.arange(ow, dtype=np.float32) + 0.5
    den = np.zeros((oh, ow), np.float32)
    s = sigma / stride
    for x, y in points / stride:
        if not (0 <= x < ow and 0 <= y < oh):
            continue
        gx = np.exp(-(xs - x) ** 2 / (2 * s * s))
        gy = np.exp(-(ys - y) ** 2 / (2 * s * s))
        k = np.outer(gy, gx)
        den += k / max(k.sum(), 1e-12)
    return den


class JHU(Dataset):
    def __init__(self, root, split, crop, sigma, train):
        self.img_dir, self.gt_dir = os.path.join(root, split, "images"), os.path.join(root, split, "gt")
        self.names = sorted(f[:-4] for f in os.listdir(self.img_dir) if f.endswith(".jpg"))
        self.crop, self.sigma, self.train = crop, sigma, train
        self.tf = transforms.Compose([transforms.ToTensor(),
                                      transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.img_dir, self.names[i] + ".jpg")).convert("RGB")
        pts = load_points(os.path.join(self.gt_dir, self.names[i] + ".txt"))
        w, h = img.size
        if self.train:
            f = random.uniform(0.7, 1.3)
            if min(w, h) * f < self.crop:
                f = self.crop / min(w, h)
            w, h = int(w * f + 0.5), int(h * f + 0.5)
            img, pts = img.resize((w, h), Image.BILINEAR), pts * f
            x0, y0 = random.randint(0, w - self.crop), random.randint(0, h - self.crop)
            img = img.crop((x0, y0, x0 + self.crop, y0 + self.crop))
            pts = pts - [x0, y0]
            w = h = self.crop
            if random.random() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
                pts[:, 0] = w - pts[:, 0]
            den = points_to_density(pts, h, w, self.sigma)
            return self.tf(img), torch.from_numpy(den)[None]
        w8, h8 = w // 8 * 8, h // 8 * 8
        return self.tf(img.crop((0, 0, w8, h8))), torch.tensor(float(len(pts))), i


class ContextualModule(nn.Module):
    def __init__(self, ch=512, sizes=(1, 2, 3, 6)):
        super().__init__()
        self.scales = nn.ModuleList([nn.Sequential(nn.AdaptiveAvgPool2d(s), nn.Conv2d(ch, ch, 1, bias=False))
                                     for s in sizes])
        self.weight_net = nn.Conv2d(ch, ch, 1)
        self.bottleneck = nn.Conv2d(ch * 2, ch, 1)

    def forward(self, feats):
        h, w = feats.shape[-2:]
        multi = [F.interpolate(stage(feats), size=(h, w), mode="bilinear", align_corners=False) for stage in self.scales]
        weights = [torch.sigmoid(self.weight_net(feats - m)) for m in multi]
        ctx = sum(m * wt for m, wt in zip(multi, weights)) / (sum(weights) + 1e-6)
        return F.relu(self.bottleneck(torch.cat([ctx, feats], 1)))


class CANNet(nn.Module):
    def __init__(self):
        super().__init__()
        vgg = models.vgg16_bn(weights="IMAGENET1K_V1")
        self.frontend = nn.Sequential(*list(vgg.features.children())[:33])  # up to conv4_3 + BN + ReLU
        self.context = ContextualModule(512)
        layers, cin = [], 512
        for cout in (512, 512, 512, 256, 128, 64):
            layers += [nn.Conv2d(cin, cout, 3, padding=2, dilation=2), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
            cin = cout
        self.backend = nn.Sequential(*layers)
        self.output_layer = nn.Conv2d(64, 1, 1)

    def forward(self, x):
        return self.output_layer(self.backend(self.context(self.frontend(x))))


def main():
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    train_set = JHU(args.data, "train", args.crop, args.sigma, train=True)
    val_set = JHU(args.data, "val", args.crop, args.sigma, train=False)
    train_sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers)

    model = CANNet()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)

    start_epoch, best_mae = 0, float("inf")
    if args.resume and os.path.isfile(args.resume):
        checkpoint = torch.load(args.resume)
        model.module.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        start_epoch, best_mae = checkpoint["epoch"], checkpoint["best_mae"]
        if rank == 0:
            print(f"=> resumed from {args.resume} (epoch {start_epoch}, best MAE {best_mae:.2f})", flush=True)

    writer = SummaryWriter(os.path.join(args.exp, "tb")) if rank == 0 else None
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        end = time.time()
        for i, (img, den) in enumerate(train_loader):
            img, den = img.cuda(non_blocking=True), den.cuda(non_blocking=True)
            pred = model(img)
            loss = F.mse_loss(pred, den, reduction="sum") / img.size(0)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if rank == 0 and i % args.print_freq == 0:
                print(f"Epoch [{epoch}][{i}/{len(train_loader)}] loss {loss.item():.4f} "
                      f"({time.time() - end:.1f}s)", flush=True)
                writer.add_scalar("loss", loss.item(), epoch * len(train_loader) + i)

        model.eval()
        results = []
        with torch.no_grad():
            for img, count, idx in val_loader:
                pred = model(img.cuda(non_blocking=True)).sum().item()
                results.append((int(idx), pred, float(count)))
        gathered = [None] * world_size
        dist.all_gather_object(gathered, results)
        if rank == 0:
            per_img = {i: (p, g) for part in gathered for i, p, g in part}
            err = np.array([p - g for p, g in per_img.values()])
            mae, mse = np.abs(err).mean(), np.sqrt((err ** 2).mean())
            writer.add_scalar("val/mae", mae, epoch)
            writer.add_scalar("val/mse", mse, epoch)
            is_best = mae < best_mae
            best_mae = min(mae, best_mae)
            print(f" * epoch {epoch} MAE {mae:.3f} MSE {mse:.3f} best MAE {best_mae:.3f}", flush=True)
            os.makedirs(args.exp, exist_ok=True)
            ckpt_path = os.path.join(args.exp, "checkpoint.pth.tar")
            torch.save({"epoch": epoch + 1, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "best_mae": best_mae}, ckpt_path)
            if is_best:
                shutil.copyfile(ckpt_path, os.path.join(args.exp, "model_best.pth.tar"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
