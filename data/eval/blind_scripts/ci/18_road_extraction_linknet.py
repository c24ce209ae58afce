"""Road extraction from 0.5 m satellite imagery (DeepGlobe road challenge layout).

<root>/train/<id>_sat.jpg + <id>_mask.png, 1024x1024; we train on random
512 crops and validate on full tiles with relaxed (buffered) road IoU.

    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d \
        --rdzv_endpoint=gpu-node01:29400 18_road_extraction_linknet.py \
        --root /nfs/deepglobe_roads --output-dir /nfs/experiments/roads_dlinknet
"""
import argparse
import os
import shutil
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

MEAN = np.array([0.408, 0.381, 0.285], np.float32)
STD = np.array([0.169, 0.139, 0.127], np.float32)


def parse_args():
    p = argparse.ArgumentParser(description="D-LinkNet road extraction")
    p.add_argument("--root", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--crop", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--val-ids", default="val_ids.txt")
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


class RoadTiles(Dataset):
    def __init__(self, root, ids, crop=None):
        self.root, self.ids, self.crop = root, ids, crop

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        tid = self.ids[i]
        img = cv2.cvtColor(cv2.imread(os.path.join(self.root, "train", f"{tid}_sat.jpg")), cv2.COLOR_BGR2RGB)
        mask = cv2.imread(os.path.join(self.root, "train", f"{tid}_mask.png"), cv2.IMREAD_GRAYSCALE)
        img = (img.astype(np.float32) / 255.0 - MEAN) / STD
        mask = (mask > 127).astype(np.float32)
        if self.crop:
            y, x = np.random.randint(0, img.shape[0] - self.crop + 1, 2)
            img, mask = img[y:y + self.crop, x:x + self.crop], mask[y:y + self.crop, x:x + self.crop]
            if np.random.rand() < 0.5:
                img, mask = img[:, ::-1], mask[:, ::-1]
            if np.random.rand() < 0.5:
                img, mask = img[::-1], mask[::-1]
            if np.random.rand() < 0.5:
                img, mask = img.transpose(1, 0, 2), mask.T
        return torch.from_numpy(img.transpose(2, 0, 1).copy()), torch.from_numpy(mask.copy())[None]


class DBlock(nn.Module):
    """Dilated centre block of D-LinkNet."""

    def __init__(self, ch):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(ch, ch, 3, padding=d, dilation=d) for d in (1, 2, 4, 8)])

    def forward(self, x):
        out, h = x, x
        for conv in self.convs:
            h = F.relu(conv(h), inplace=True)
            out = out + h
        return out


class DecoderBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        mid = cin // 4
        self.block = nn.Sequential(
            nn.Conv2d(cin, mid, 1), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
            nn.ConvTranspose2d(mid, mid, 3, stride=2, padding=1, output_padding=1), nn.BatchNorm2d(mid),
            nn.ReLU(inplace=True), nn.Conv2d(mid, cout, 1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

    def forward(self, x):
        return self.block(x)


class DLinkNet34(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet34(weights=None)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.e1, self.e2, self.e3, self.e4 = r.layer1, r.layer2, r.layer3, r.layer4
        self.center = DBlock(512)
        self.d4, self.d3 = DecoderBlock(512, 256), DecoderBlock(256, 128)
        self.d2, self.d1 = DecoderBlock(128, 64), DecoderBlock(64, 64)
        self.final = nn.Sequential(nn.ConvTranspose2d(64, 32, 4, 2, 1), nn.ReLU(inplace=True),
                                   nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(32, 1, 1))

    def forward(self, x):
        x = self.stem(x)
        e1 = self.e1(x)
        e2 = self.e2(e1)
        e3 = self.e3(e2)
        e4 = self.center(self.e4(e3))
        d4 = self.d4(e4) + e3
        d3 = self.d3(d4) + e2
        d2 = self.d2(d3) + e1
        return self.final(self.d1(d2))


def dice_bce(logits, target):
    p = torch.sigmoid(logits)
    inter = (p * target).sum((1, 2, 3))
    dice = 1 - (2 * inter + 1) / (p.sum((1, 2, 3)) + target.sum((1, 2, 3)) + 1)
    return F.binary_cross_entropy_with_logits(logits, target) + dice.mean()


def save_checkpoint(state, is_best, out_dir):
    path = os.path.join(out_dir, "checkpoint.pth")
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, os.path.join(out_dir, "model_best.pth"))


@torch.no_grad()
def relaxed_iou(net, loader, device, buffer_px=3):
    net.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)   # tp, fp, fn (relaxed)
    kernel = torch.ones(1, 1, 2 * buffer_px + 1, 2 * buffer_px + 1, device=device)
    for img, mask in loader:
        img, mask = img.to(device), mask.to(device)
        pred = (torch.sigmoid(net(img)) > 0.5).float()
        pred_buf = (F.conv2d(pred, kernel, padding=buffer_px) > 0).float()
        gt_buf = (F.conv2d(mask, kernel, padding=buffer_px) > 0).float()
        acc[0] += (pred * gt_buf).sum()
        acc[1] += (pred * (1 - gt_buf)).sum()
        acc[2] += (mask * (1 - pred_buf)).sum()
    dist.all_reduce(acc)
    tp, fp, fn = acc.tolist()
    return tp / max(tp + fp + fn, 1.0)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    all_ids = sorted(f[:-8] for f in os.listdir(os.path.join(args.root, "train")) if f.endswith("_sat.jpg"))
    with open(os.path.join(args.root, args.val_ids)) as f:
        val_ids = sorted(l.strip() for l in f if l.strip())
    val_set = set(val_ids)
    train_ids = [i for i in all_ids if i not in val_set]

    train_ds = RoadTiles(args.root, train_ids, crop=args.crop)
    val_ds = RoadTiles(args.root, val_ids)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), batch_size=2,
                        num_workers=4)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(DLinkNet34()).to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=args.lr * world)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=6)
    start_epoch, best = 0, 0.0
    ckpt_path = os.path.join(args.output_dir, "checkpoint.pth")
    if args.resume and os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
    model = DDP(net, device_ids=[local_rank])
    os.makedirs(args.output_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for img, mask in train_dl:
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            loss = dice_bce(model(img), mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach(), torch.ones_like(loss)])
        dist.all_reduce(loss_sum)

        iou = relaxed_iou(net, val_dl, device)
        scheduler.step(iou)
        is_best = iou > best
        best = max(best, iou)
        if rank == 0:
            print(f"epoch {epoch} loss {(loss_sum[0] / loss_sum[1]).item():.4f} relaxed IoU {iou:.4f} "
                  f"lr {optimizer.param_groups[0]['lr']:.2e} ({time.time() - t0:.0f}s)", flush=True)
        save_checkpoint({"epoch": epoch, "model": net.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "best": best}, is_best, args.output_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
