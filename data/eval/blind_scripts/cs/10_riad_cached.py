"""RIAD - Reconstruction by Inpainting for visual Anomaly Detection, multi-GPU.

Decoding PNGs at 1024x1024 and resizing dominated the step time, so the resized training
images of a category are decoded once and kept as a uint8 .npy array next to the dataset.

    torchrun --nproc_per_node=8 10_riad_cached.py --category leather --cache-dir /shared/cache/riad
"""
import argparse
import os
import random
from pathlib import Path

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pytorch_msssim import ssim
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm


def load_split(root, category, split, size):
    files = sorted((Path(root) / category / split).glob("*/*.png"))
    imgs, masks, labels = [], [], []
    for f in files:
        img = cv2.cvtColor(cv2.imread(str(f)), cv2.COLOR_BGR2RGB)
        imgs.append(cv2.resize(img, (size, size), interpolation=cv2.INTER_AREA))
        if split == "test":
            defect = f.parent.name
            if defect == "good":
                masks.append(np.zeros((size, size), np.uint8))
            else:
                gt = cv2.imread(str(Path(root) / category / "ground_truth" / defect / f"{f.stem}_mask.png"), 0)
                masks.append((cv2.resize(gt, (size, size), interpolation=cv2.INTER_NEAREST) > 127).astype(np.uint8))
            labels.append(int(defect != "good"))
    return np.stack(imgs), (np.stack(masks) if masks else None), np.array(labels)


def cached_train_images(root, category, size, cache_dir):
    cache_file = Path(cache_dir) / f"{category}_train_{size}.npy"
    if not cache_file.exists():
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        imgs, _, _ = load_split(root, category, "train", size)
        np.save(cache_file, imgs)
    return np.load(cache_file)


class InpaintTrainSet(Dataset):
    def __init__(self, images):
        self.images = images  # N, H, W, 3 uint8

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = self.images[i]
        if random.random() < 0.5:
            img = img[:, ::-1]
        if random.random() < 0.5:
            img = img[::-1]
        return torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1).float() / 255.0


def grid_masks(b, size, k, device):
    """k x k cell partition of the image into 3 disjoint random masks (RIAD)."""
    cells = size // k
    perm = torch.stack([torch.randperm(cells * cells, device=device) for _ in range(b)])
    groups = (perm % 3).view(b, 1, cells, cells).float()
    groups = F.interpolate(groups, scale_factor=k, mode="nearest")
    return [(groups == g).float() for g in range(3)]


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.InstanceNorm2d(cout, affine=True), nn.ReLU(True),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.InstanceNorm2d(cout, affine=True), nn.ReLU(True))


class InpaintUNet(nn.Module):
    def __init__(self, base=64):
        super().__init__()
        c = [base, base * 2, base * 4, base * 8]
        self.e1, self.e2, self.e3, self.e4 = block(3, c[0]), block(c[0], c[1]), block(c[1], c[2]), block(c[2], c[3])
        self.u3, self.u2, self.u1 = (nn.ConvTranspose2d(c[3], c[2], 2, 2), nn.ConvTranspose2d(c[2], c[1], 2, 2),
                                     nn.ConvTranspose2d(c[1], c[0], 2, 2))
        self.d3, self.d2, self.d1 = block(c[3], c[2]), block(c[2], c[1]), block(c[1], c[0])
        self.out = nn.Conv2d(c[0], 3, 1)

    def forward(self, x):
        e1 = self.e1(x)
        e2 = self.e2(F.max_pool2d(e1, 2))
        e3 = self.e3(F.max_pool2d(e2, 2))
        e4 = self.e4(F.max_pool2d(e3, 2))
        d3 = self.d3(torch.cat([self.u3(e4), e3], 1))
        d2 = self.d2(torch.cat([self.u2(d3), e2], 1))
        d1 = self.d1(torch.cat([self.u1(d2), e1], 1))
        return torch.sigmoid(self.out(d1))


def inpaint(model, x, k):
    masks = grid_masks(x.shape[0], x.shape[-1], k, x.device)
    outs = model(torch.cat([x * (1 - m) for m in masks])).chunk(len(masks))
    return sum(o * m for o, m in zip(outs, masks))


def gms_loss(a, b):
    kx = torch.tensor([[1, 0, -1], [1, 0, -1], [1, 0, -1]], dtype=a.dtype, device=a.device).view(1, 1, 3, 3) / 3
    ky = kx.transpose(2, 3)
    ga, gb = a.mean(1, keepdim=True), b.mean(1, keepdim=True)
    ma = torch.sqrt(F.conv2d(ga, kx, padding=1) ** 2 + F.conv2d(ga, ky, padding=1) ** 2 + 1e-12)
    mb = torch.sqrt(F.conv2d(gb, kx, padding=1) ** 2 + F.conv2d(gb, ky, padding=1) ** 2 + 1e-12)
    c = 0.0026
    return 1 - ((2 * ma * mb + c) / (ma ** 2 + mb ** 2 + c))


@torch.no_grad()
def test(model, root, category, size, device, ks=(2, 4, 8, 16)):
    imgs, masks, labels = load_split(root, category, "test", size)
    model.eval()
    scores, pix = [], []
    x_all = torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 255.0
    for (x,) in DataLoader(TensorDataset(x_all), batch_size=16):
        x = x.to(device)
        amap = sum(gms_loss(x, inpaint(model, x, k)) for k in ks) / len(ks)
        amap = F.avg_pool2d(amap, 21, 1, 10)
        scores.append(amap.flatten(1).max(1).values.cpu())
        pix.append(amap.squeeze(1).cpu())
    model.train()
    pix = torch.cat(pix).numpy()
    return roc_auc_score(labels, torch.cat(scores).numpy()), roc_auc_score(masks.ravel(), pix.ravel())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="/shared/datasets/mvtec_ad")
    ap.add_argument("--cache-dir", default="/shared/cache/riad")
    ap.add_argument("--category", default="leather")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--out", default="/shared/runs/riad")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    random.seed(rank)

    train_imgs = cached_train_images(args.data_root, args.category, args.size, args.cache_dir)
    train_set = InpaintTrainSet(train_imgs)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    model = DDP(InpaintUNet().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-5)

    out_dir = Path(args.out) / args.category
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        pbar = tqdm(loader, disable=rank != 0, desc=f"epoch {epoch}")
        for x in pbar:
            x = x.to(device, non_blocking=True)
            k = random.choice([2, 4, 8, 16])
            rec = inpaint(model, x, k)
            loss = F.mse_loss(rec, x) + gms_loss(rec, x).mean() + (1 - ssim(rec, x, data_range=1.0))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            pbar.set_postfix(loss=f"{loss.item():.4f}")

        if rank == 0 and (epoch + 1) % 25 == 0:
            img_auc, pix_auc = test(model.module, args.data_root, args.category, args.size, device)
            print(f"epoch {epoch}: image AUROC {img_auc:.4f} pixel AUROC {pix_auc:.4f}", flush=True)
            out_dir.mkdir(parents=True, exist_ok=True)
            torch.save(model.module.state_dict(), out_dir / "last.pt")
            if img_auc > best:
                best = img_auc
                torch.save(model.module.state_dict(), out_dir / "best.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
