"""UPerNet (ConvNeXt-S encoder, segmentation_models_pytorch) on LoveDA,
with a final multi-scale + flip evaluation of the best checkpoint.

    torchrun --nproc_per_node=4 20_loveda_upernet_mstest.py --root /datasets/LoveDA
"""
import argparse
import glob
import os
import random
import time

import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ("background", "building", "road", "water", "barren", "forest", "agricultural")
IGNORE = 255


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/datasets/LoveDA")
    ap.add_argument("--work-dir", default="work_dirs/upernet_convnext_s_loveda")
    ap.add_argument("--crop", type=int, default=512)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=6e-5)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--val-every", type=int, default=5)
    ap.add_argument("--ms-scales", type=float, nargs="+", default=[0.75, 1.0, 1.25, 1.5])
    return ap.parse_args()


class LoveDA(Dataset):
    mean = np.array([123.675, 116.28, 103.53], np.float32)
    std = np.array([58.395, 57.12, 57.375], np.float32)

    def __init__(self, root, split, crop, train):
        sub = "Train" if split == "train" else "Val"
        self.imgs = sorted(glob.glob(f"{root}/{sub}/*/images_png/*.png"))
        self.crop, self.train = crop, train

    def __len__(self):
        return len(self.imgs)

    def __getitem__(self, i):
        img = Image.open(self.imgs[i]).convert("RGB")
        lbl = np.asarray(Image.open(self.imgs[i].replace("images_png", "masks_png")), np.int64) - 1
        lbl[lbl < 0] = IGNORE  # 0 = no-data
        if self.train:
            s = random.uniform(0.5, 2.0)
            size = (int(img.width * s), int(img.height * s))
            img = np.asarray(img.resize(size, Image.BILINEAR), np.float32)
            lbl = np.asarray(Image.fromarray(lbl.astype(np.uint8)).resize(size, Image.NEAREST), np.int64)
            ph, pw = max(self.crop - lbl.shape[0], 0), max(self.crop - lbl.shape[1], 0)
            img = np.pad(img, ((0, ph), (0, pw), (0, 0)))
            lbl = np.pad(lbl, ((0, ph), (0, pw)), constant_values=IGNORE)
            y, x = random.randint(0, lbl.shape[0] - self.crop), random.randint(0, lbl.shape[1] - self.crop)
            img, lbl = img[y:y + self.crop, x:x + self.crop], lbl[y:y + self.crop, x:x + self.crop]
            if random.random() < 0.5:
                img, lbl = img[:, ::-1], lbl[:, ::-1]
            if random.random() < 0.5:
                img, lbl = img[::-1], lbl[::-1]
        else:
            img = np.asarray(img, np.float32)
        img = (img - self.mean) / self.std
        return torch.from_numpy(img.transpose(2, 0, 1).copy()), torch.from_numpy(lbl.copy())


def build_model():
    return smp.UPerNet(encoder_name="tu-convnext_small", encoder_weights="imagenet", classes=len(CLASSES))


def predict(net, img, scales=(1.0,), flip=False):
    H, W = img.shape[-2:]
    prob = 0
    for s in scales:
        h, w = int(H * s / 32 + 0.5) * 32, int(W * s / 32 + 0.5) * 32
        x = F.interpolate(img, size=(h, w), mode="bilinear", align_corners=False)
        views = [x, x.flip(-1)] if flip else [x]
        for k, v in enumerate(views):
            out = net(v)
            if k == 1:
                out = out.flip(-1)
            prob = prob + F.interpolate(out, size=(H, W), mode="bilinear", align_corners=False).softmax(1)
    return prob


@torch.no_grad()
def evaluate(net, loader, device, scales=(1.0,), flip=False):
    net.eval()
    n = len(CLASSES)
    hist = torch.zeros(n * n, dtype=torch.int64, device=device)
    for img, lbl in loader:
        img, lbl = img.to(device), lbl.to(device)
        pred = predict(net, img, scales, flip).argmax(1)
        k = lbl != IGNORE
        hist += torch.bincount(lbl[k] * n + pred[k], minlength=n * n)
    dist.all_reduce(hist)
    h = hist.view(n, n).double()
    net.train()
    return h.diag() / (h.sum(0) + h.sum(1) - h.diag())


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(0)
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    train_ds = LoveDA(args.root, "train", args.crop, True)
    val_ds = LoveDA(args.root, "val", args.crop, False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), 1, num_workers=2)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(build_model()).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.AdamW([
        {"params": net.encoder.parameters(), "lr": args.lr},
        {"params": [p for n, p in net.named_parameters() if not n.startswith("encoder.")], "lr": args.lr * 10},
    ], weight_decay=0.01)
    total = args.epochs * len(loader)
    warmup = min(1500, total // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: (i + 1) / warmup if i < warmup else (1 - (i - warmup) / (total - warmup)) ** 1.0)
    best_path = os.path.join(args.work_dir, "best.pth")

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for img, lbl in loader:
            img, lbl = img.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
            loss = F.cross_entropy(model(img), lbl, ignore_index=IGNORE)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sched.step()
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)
        if (epoch + 1) % args.val_every == 0 or epoch + 1 == args.epochs:
            iou = evaluate(net, val_loader, device)
            miou = torch.nanmean(iou).item()
            if rank == 0:
                print(f"  val mIoU {100 * miou:.2f}", flush=True)
                if miou > best:
                    torch.save({"state_dict": model.state_dict(), "epoch": epoch + 1, "mIoU": miou}, best_path)
            best = max(best, miou)
            dist.barrier()

    # final multi-scale + flip test of the best checkpoint
    test_net = build_model()
    ckpt = torch.load(best_path, map_location="cpu")
    test_net.load_state_dict(ckpt["state_dict"])
    test_net.to(device)
    iou = evaluate(test_net, val_loader, device, scales=tuple(args.ms_scales), flip=True)
    if rank == 0:
        print(f"best epoch {ckpt['epoch']}: ss mIoU {100 * ckpt['mIoU']:.2f} | "
              f"ms+flip mIoU {100 * torch.nanmean(iou).item():.2f}", flush=True)
        for c, v in zip(CLASSES, iou.tolist()):
            print(f"  {c:>14s}: {100 * v:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
