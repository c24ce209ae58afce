"""Crowd counting with a VGG19 density regressor (ShanghaiTech A / UCF-QNRF).

Ground-truth density maps use a fixed-sigma Gaussian at each head point and are
precomputed into <root>/<split>/density/*.npy on the first run.

torchrun --nnodes=1 --nproc_per_node=8 04_vgg19_density_sha.py \
    --root /mnt/shared/crowd/ShanghaiTech/part_A --save-dir /mnt/shared/exp/vgg19_sha
"""
import argparse
import datetime
import glob
import math
import os
import random

import numpy as np
import scipy.io as sio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from scipy.ndimage import gaussian_filter
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torchvision import models
from torchvision import transforms as T


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--crop", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=1, help="images per GPU")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--max-epoch", type=int, default=1000)
    p.add_argument("--val-start", type=int, default=50)
    p.add_argument("--val-epoch", type=int, default=5)
    p.add_argument("--sigma", type=float, default=4.0)
    p.add_argument("--resume", default="")
    p.add_argument("--num-workers", type=int, default=4)
    return p.parse_args()


def prepare_density(split_dir, sigma):
    out_dir = os.path.join(split_dir, "density")
    os.makedirs(out_dir, exist_ok=True)
    for img_path in sorted(glob.glob(os.path.join(split_dir, "images", "*.jpg"))):
        name = os.path.basename(img_path)[:-4]
        dst = os.path.join(out_dir, name + ".npy")
        if os.path.isfile(dst):
            continue
        w, h = Image.open(img_path).size
        pts = sio.loadmat(os.path.join(split_dir, "ground-truth", f"GT_{name}.mat"))["image_info"][0, 0][0, 0][0]
        den = np.zeros((h, w), np.float32)
        for x, y in pts:
            den[min(int(y), h - 1), min(int(x), w - 1)] += 1.0
        den = gaussian_filter(den, sigma, mode="constant")
        tmp = dst + ".tmp.npy"
        np.save(tmp, den)
        os.replace(tmp, dst)


class Crowd(Dataset):
    def __init__(self, split_dir, crop, train):
        self.imgs = sorted(glob.glob(os.path.join(split_dir, "images", "*.jpg")))
        self.den_dir = os.path.join(split_dir, "density")
        self.crop, self.train = crop, train
        self.norm = T.Compose([T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.imgs)

    def __getitem__(self, i):
        img = Image.open(self.imgs[i]).convert("RGB")
        den = np.load(os.path.join(self.den_dir, os.path.basename(self.imgs[i])[:-4] + ".npy"))
        if not self.train:
            return self.norm(img), float(den.sum())
        w, h = img.size
        if min(w, h) < self.crop:
            r = self.crop / min(w, h)
            nw, nh = math.ceil(w * r), math.ceil(h * r)
            img = img.resize((nw, nh), Image.BICUBIC)
            den = np.array(Image.fromarray(den).resize((nw, nh), Image.BICUBIC)) * (w * h) / (nw * nh)
            w, h = nw, nh
        x0, y0 = random.randint(0, w - self.crop), random.randint(0, h - self.crop)
        img = img.crop((x0, y0, x0 + self.crop, y0 + self.crop))
        den = den[y0:y0 + self.crop, x0:x0 + self.crop]
        if random.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
            den = den[:, ::-1]
        # sum-pool to 1/8 resolution so counts are preserved exactly
        den = den.reshape(self.crop // 8, 8, self.crop // 8, 8).sum(axis=(1, 3))
        return self.norm(img), torch.from_numpy(np.ascontiguousarray(den))[None].float()


class ShardSampler(Sampler):
    """Each rank takes indices[rank::world_size]; no padding, so every image is scored exactly once."""

    def __init__(self, n, rank, world_size):
        self.indices = list(range(n))[rank::world_size]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


class VGG19Density(nn.Module):
    def __init__(self):
        super().__init__()
        vgg = models.vgg19(weights=None)
        self.features = nn.Sequential(*list(vgg.features.children())[:36])  # stride 16, drop last pool
        self.reg = nn.Sequential(
            nn.Conv2d(512, 256, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 128, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(128, 1, 1), nn.ReLU(),
        )

    def forward(self, x):
        f = F.interpolate(self.features(x), scale_factor=2, mode="bilinear", align_corners=False)
        return self.reg(f)


@torch.no_grad()
def validate(net, loader):
    net.eval()
    stats = torch.zeros(3, dtype=torch.float64, device="cuda")  # |err|, err^2, n
    for img, gt in loader:
        pred = net(img.cuda(non_blocking=True)).sum().double()
        err = pred - gt.cuda().double()
        stats += torch.stack([err.abs().sum(), (err ** 2).sum(), torch.ones_like(pred)])
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).sqrt().item()


def main():
    args = parse()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    # generous timeout: on the first run rank 0 renders all density maps while the others wait
    dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=datetime.timedelta(hours=2))

    train_dir = os.path.join(args.root, "train_data")
    test_dir = os.path.join(args.root, "test_data")
    if rank == 0:
        prepare_density(train_dir, args.sigma)
        prepare_density(test_dir, args.sigma)
        os.makedirs(args.save_dir, exist_ok=True)
    dist.barrier()

    train_set = Crowd(train_dir, args.crop, train=True)
    test_set = Crowd(test_dir, args.crop, train=False)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=1, sampler=ShardSampler(len(test_set), rank, world_size),
                             num_workers=2, pin_memory=True)

    net = VGG19Density()
    if not args.resume:
        vgg_sd = models.vgg19(weights="IMAGENET1K_V1").features.state_dict()
        net.features.load_state_dict({k: v for k, v in vgg_sd.items() if int(k.split(".")[0]) < 36})
    net = net.cuda()
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.wd)

    start_epoch, best_mae, best_mse = 0, float("inf"), float("inf")
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best_mae, best_mse = ckpt["epoch"] + 1, ckpt["best_mae"], ckpt["best_mse"]

    for epoch in range(start_epoch, args.max_epoch):
        sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device="cuda")
        for img, den in train_loader:
            img, den = img.cuda(non_blocking=True), den.cuda(non_blocking=True)
            pred = model(img)
            count_loss = F.l1_loss(pred.sum(dim=(1, 2, 3)), den.sum(dim=(1, 2, 3)))
            den_loss = F.mse_loss(pred, den, reduction="sum") / img.size(0)
            loss = den_loss + 0.1 * count_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device="cuda")])
        dist.all_reduce(loss_sum)
        if rank == 0:
            print(f"epoch {epoch} train loss {(loss_sum[0] / loss_sum[1]).item():.4f}", flush=True)

        if epoch >= args.val_start and epoch % args.val_epoch == 0:
            # the wrapped model is not used here: ranks may get one image more or less
            mae, mse = validate(net, test_loader)
            if rank == 0:
                print(f"epoch {epoch} MAE {mae:.2f} MSE {mse:.2f}", flush=True)
                state = dict(model=net.state_dict(), optimizer=optimizer.state_dict(), epoch=epoch,
                             best_mae=min(mae, best_mae), best_mse=mse if mae < best_mae else best_mse)
                torch.save(state, os.path.join(args.save_dir, "last.pth"))
                if mae < best_mae:
                    torch.save(net.state_dict(), os.path.join(args.save_dir, "best_model.pth"))
            if mae < best_mae:
                best_mae, best_mse = mae, mse

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
