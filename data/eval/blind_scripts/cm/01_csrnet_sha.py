"""
CSRNet training on ShanghaiTech Part A with DistributedDataParallel.

Density maps are generated with geometry-adaptive Gaussian kernels
(3 nearest neighbours, beta = 0.3) and cached as .npy next to the images
so later runs start immediately.

    torchrun --nproc_per_node=4 01_csrnet_sha.py --data-root /data/ShanghaiTech/part_A
"""
import argparse
import glob
import logging
import os
import random
import time

import cv2
import numpy as np
import scipy.io as sio
import scipy.spatial
from scipy.ndimage import gaussian_filter
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms

logger = logging.getLogger("csrnet")


def parse_args():
    p = argparse.ArgumentParser(description="CSRNet / ShanghaiTech A")
    p.add_argument("--data-root", required=True)
    p.add_argument("--output-dir", default="./output/csrnet_sha")
    p.add_argument("--epochs", type=int, default=400)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--crop-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--val-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def gaussian_filter_density(points, shape):
    """Geometry-adaptive kernels as in the MCNN / CSRNet papers."""
    density = np.zeros(shape, dtype=np.float32)
    if len(points) == 0:
        return density
    tree = scipy.spatial.KDTree(points.copy(), leafsize=2048)
    k = min(4, len(points))
    distances, _ = tree.query(points, k=k)
    for i, pt in enumerate(points):
        x = min(max(int(pt[0]), 0), shape[1] - 1)
        y = min(max(int(pt[1]), 0), shape[0] - 1)
        delta = np.zeros(shape, dtype=np.float32)
        delta[y, x] = 1.0
        if len(points) > 1:
            sigma = float(np.sum(distances[i][1:k])) * 0.1
        else:
            sigma = float(np.mean(shape)) / 4.0
        density += gaussian_filter(delta, sigma, mode="constant")
    return density


def build_density_cache(split_dir):
    img_dir = os.path.join(split_dir, "images")
    gt_dir = os.path.join(split_dir, "ground-truth")
    den_dir = os.path.join(split_dir, "density")
    os.makedirs(den_dir, exist_ok=True)
    img_paths = sorted(glob.glob(os.path.join(img_dir, "*.jpg")))
    for img_path in img_paths:
        name = os.path.splitext(os.path.basename(img_path))[0]
        den_path = os.path.join(den_dir, name + ".npy")
        if os.path.exists(den_path):
            continue
        h, w = cv2.imread(img_path).shape[:2]
        mat = sio.loadmat(os.path.join(gt_dir, "GT_" + name + ".mat"))
        points = mat["image_info"][0, 0][0, 0][0].astype(np.float32)
        np.save(den_path, gaussian_filter_density(points, (h, w)))
    return img_paths


class CrowdDataset(Dataset):
    def __init__(self, img_paths, train=True, crop_size=256, downsample=8):
        self.img_paths = img_paths
        self.train = train
        self.crop_size = crop_size
        self.downsample = downsample
        self.to_tensor = transforms.Compose([
            transforms.ToTensor(),
            transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
        ])

    def __len__(self):
        return len(self.img_paths)

    def _den_path(self, img_path):
        name = os.path.splitext(os.path.basename(img_path))[0]
        return os.path.join(os.path.dirname(os.path.dirname(img_path)), "density", name + ".npy")

    def __getitem__(self, idx):
        img_path = self.img_paths[idx]
        img = cv2.cvtColor(cv2.imread(img_path), cv2.COLOR_BGR2RGB)
        den = np.load(self._den_path(img_path))
        ds = self.downsample
        if self.train:
            h, w = den.shape
            cs = self.crop_size
            if min(h, w) < cs:
                scale = cs / min(h, w)
                nh, nw = int(np.ceil(h * scale)), int(np.ceil(w * scale))
                img = cv2.resize(img, (nw, nh))
                den = cv2.resize(den, (nw, nh), interpolation=cv2.INTER_CUBIC) * (h * w) / (nh * nw)
                h, w = nh, nw
            y0 = random.randint(0, h - cs)
            x0 = random.randint(0, w - cs)
            img = img[y0:y0 + cs, x0:x0 + cs]
            den = den[y0:y0 + cs, x0:x0 + cs]
            if random.random() < 0.5:
                img = img[:, ::-1]
                den = den[:, ::-1]
        else:
            h, w = den.shape
            h, w = h // ds * ds, w // ds * ds
            img, den = img[:h, :w], den[:h, :w]
        count = float(den.sum())
        th, tw = den.shape[0] // ds, den.shape[1] // ds
        den = cv2.resize(np.ascontiguousarray(den), (tw, th), interpolation=cv2.INTER_CUBIC) * (ds * ds)
        return self.to_tensor(np.ascontiguousarray(img)), torch.from_numpy(den[None]).float(), count


def make_layers(cfg, in_channels=3, dilation=False):
    d = 2 if dilation else 1
    layers = []
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(in_channels, v, 3, padding=d, dilation=d), nn.ReLU(inplace=True)]
            in_channels = v
    return nn.Sequential(*layers)


class CSRNet(nn.Module):
    def __init__(self, load_vgg=True):
        super().__init__()
        self.frontend = make_layers([64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512])
        self.backend = make_layers([512, 512, 512, 256, 128, 64], in_channels=512, dilation=True)
        self.output_layer = nn.Conv2d(64, 1, kernel_size=1)
        for m in list(self.backend.modules()) + [self.output_layer]:
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(m.weight, std=0.01)
                nn.init.constant_(m.bias, 0)
        if load_vgg:
            vgg = models.vgg16(weights=models.VGG16_Weights.IMAGENET1K_V1)
            vgg_values = list(vgg.features.state_dict().values())
            front = self.frontend.state_dict()
            for i, k in enumerate(front.keys()):
                front[k] = vgg_values[i]
            self.frontend.load_state_dict(front)

    def forward(self, x):
        return self.output_layer(self.backend(self.frontend(x)))


@torch.no_grad()
def evaluate(model, loader, device, world_size, num_samples):
    model.eval()
    preds, gts = [], []
    for img, _, count in loader:
        out = model(img.to(device, non_blocking=True))
        preds.append(out.sum().reshape(1))
        gts.append(count.to(device, dtype=torch.float32).reshape(1))
    preds, gts = torch.cat(preds), torch.cat(gts)
    # DistributedSampler(shuffle=False) deals samples round-robin; re-interleave and drop padding
    all_p = [torch.zeros_like(preds) for _ in range(world_size)]
    all_g = [torch.zeros_like(gts) for _ in range(world_size)]
    dist.all_gather(all_p, preds)
    dist.all_gather(all_g, gts)
    preds = torch.stack(all_p, dim=1).flatten()[:num_samples]
    gts = torch.stack(all_g, dim=1).flatten()[:num_samples]
    err = preds - gts
    return err.abs().mean().item(), err.pow(2).mean().sqrt().item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    train_imgs = build_density_cache(os.path.join(args.data_root, "train_data"))
    val_imgs = build_density_cache(os.path.join(args.data_root, "test_data"))

    train_set = CrowdDataset(train_imgs, train=True, crop_size=args.crop_size)
    val_set = CrowdDataset(val_imgs, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = CSRNet(load_vgg=True).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    criterion = nn.MSELoss(reduction="sum")

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    best_mae = float("inf")

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, running = time.time(), 0.0
        for it, (img, den, _) in enumerate(train_loader):
            img = img.to(device, non_blocking=True)
            den = den.to(device, non_blocking=True)
            out = model(img)
            loss = criterion(out, den) / img.size(0)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            running += loss.item()
            if rank == 0 and it % 50 == 0:
                logger.info("epoch %d iter %d/%d loss %.4f", epoch, it, len(train_loader), loss.item())
        if rank == 0:
            logger.info("epoch %d done in %.1fs, mean loss %.4f", epoch, time.time() - t0,
                        running / max(len(train_loader), 1))

        if (epoch + 1) % args.val_every == 0:
            mae, rmse = evaluate(model, val_loader, device, world_size, len(val_set))
            if rank == 0:
                logger.info("epoch %d  MAE %.2f  MSE %.2f", epoch, mae, rmse)
                state = {"epoch": epoch, "model": model.module.state_dict(),
                         "optimizer": optimizer.state_dict(), "mae": mae}
                torch.save(state, os.path.join(args.output_dir, "last.pth"))
                if mae < best_mae:
                    best_mae = mae
                    torch.save(state, os.path.join(args.output_dir, "best.pth"))
            dist.barrier()

    if rank == 0:
        logger.info("best MAE %.2f", best_mae)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
