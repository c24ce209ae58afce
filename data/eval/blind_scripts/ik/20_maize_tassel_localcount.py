"""Maize tassel counting with a TasselNetV2-style local count regressor.

The network regresses, for every output cell, the number of tassels inside
its (overlapping) receptive window; the image count is the normalised sum.
Trained on the 2021+2022 flights, tested at the end on the held-out 2023
flights with the best checkpoint.

    torchrun --nproc_per_node=4 20_maize_tassel_localcount.py --root /data/mtc_uav
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from scipy.io import loadmat
from scipy.ndimage import gaussian_filter
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
import torchvision.transforms.functional as TF

OUT_STRIDE = 8
WINDOW = 64


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--train-seasons", nargs="+", default=["2021", "2022"])
    p.add_argument("--test-season", default="2023")
    p.add_argument("--crop", type=int, default=512)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--save", default="weights/tasselnet")
    return p.parse_args()


def local_count_map(points, h, w, sigma=8.0):
    """Density map at full res, then box-summed over WINDOW x WINDOW windows at OUT_STRIDE."""
    dens = np.zeros((h, w), dtype=np.float32)
    for x, y in points:
        xi, yi = min(int(x), w - 1), min(int(y), h - 1)
        dens[yi, xi] += 1.0
    dens = gaussian_filter(dens, sigma, mode="constant")
    t = torch.from_numpy(dens)[None, None]
    return F.avg_pool2d(t, WINDOW, stride=OUT_STRIDE, padding=WINDOW // 2 - OUT_STRIDE // 2)[0] * WINDOW * WINDOW


class TasselImages(Dataset):
    def __init__(self, root, df, crop, train):
        self.root = root
        self.df = df.reset_index(drop=True)
        self.crop = crop
        self.train = train

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        img = Image.open(os.path.join(self.root, "images", r.image)).convert("RGB")
        pts = loadmat(os.path.join(self.root, "labels", r.image.rsplit(".", 1)[0] + ".mat"))["annotation"]
        pts = np.asarray(pts, dtype=np.float32).reshape(-1, 2)
        # images are 1/2 scale of the 3648x2736 camera frames
        img = img.resize((img.width // 2, img.height // 2), Image.BILINEAR)
        pts = pts / 2
        if self.train:
            c = self.crop
            x0 = np.random.randint(0, img.width - c + 1)
            y0 = np.random.randint(0, img.height - c + 1)
            img = img.crop((x0, y0, x0 + c, y0 + c))
            pts = pts - [x0, y0]
            pts = pts[(pts[:, 0] >= 0) & (pts[:, 0] < c) & (pts[:, 1] >= 0) & (pts[:, 1] < c)]
            if np.random.rand() < 0.5:
                img = TF.hflip(img)
                pts[:, 0] = c - 1 - pts[:, 0]
            img = TF.adjust_brightness(img, np.random.uniform(0.8, 1.2))
            img = TF.adjust_contrast(img, np.random.uniform(0.8, 1.2))
        w, h = img.width // OUT_STRIDE * OUT_STRIDE, img.height // OUT_STRIDE * OUT_STRIDE
        img = img.crop((0, 0, w, h))
        x = TF.normalize(TF.to_tensor(img), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        target = local_count_map(pts, h, w)
        return x, target, float(len(pts))


class TasselNetV2(nn.Module):
    def __init__(self):
        super().__init__()

        def block(ci, co, pool=True):
            layers = [nn.Conv2d(ci, co, 3, padding=1, bias=False), nn.BatchNorm2d(co), nn.ReLU(inplace=True)]
            if pool:
                layers.append(nn.MaxPool2d(2))
            return layers

        self.encoder = nn.Sequential(*block(3, 16), *block(16, 32), *block(32, 64), *block(64, 128, pool=False))
        self.counter = nn.Sequential(
            nn.Conv2d(128, 128, WINDOW // OUT_STRIDE, padding="same", bias=False), nn.BatchNorm2d(128),
            nn.ReLU(inplace=True), nn.Conv2d(128, 128, 1), nn.ReLU(inplace=True), nn.Conv2d(128, 1, 1),
        )

    def forward(self, x):
        return F.relu(self.counter(self.encoder(x)))


def image_counts(local_map):
    # every tassel is counted in (WINDOW / OUT_STRIDE)^2 overlapping windows
    return local_map.sum(dim=(1, 2, 3)) / (WINDOW / OUT_STRIDE) ** 2


@torch.no_grad()
def count_errors(net, loader, device):
    net.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    for x, _, n in loader:
        pred = image_counts(net(x.to(device)))
        n = n.to(device)
        s += torch.stack([(pred - n).abs().sum(), ((pred - n) ** 2).sum(),
                          torch.tensor(float(len(n)), device=device, dtype=torch.float64)])
    dist.all_reduce(s)
    return (s[0] / s[2]).item(), (s[1] / s[2]).sqrt().item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(rank)
    torch.manual_seed(0)

    df = pd.read_csv(os.path.join(args.root, "index.csv"), dtype={"season": str})
    trainval = df[df.season.isin(args.train_seasons)]
    train_df = trainval[trainval.subset == "train"]
    val_df = trainval[trainval.subset == "val"]
    test_df = df[df.season == args.test_season]

    train_ds = TasselImages(args.root, train_df, args.crop, train=True)
    val_ds = TasselImages(args.root, val_df, args.crop, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=1, num_workers=2)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(TasselNetV2()).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.95, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[200, 250], gamma=0.1)

    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
    best_mae = float("inf")
    best_path = os.path.join(args.save, "best.pth")
    for epoch in range(args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for x, target, _ in train_loader:
            x, target = x.to(device, non_blocking=True), target.to(device, non_blocking=True)
            loss = F.l1_loss(model(x), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(acc)

        if epoch % 5 == 4 or epoch == args.epochs - 1:
            mae, rmse = count_errors(net, val_loader, device)
            if rank == 0:
                print(f"epoch {epoch} loss {(acc[0] / acc[1]).item():.4f} val MAE {mae:.2f} RMSE {rmse:.2f} "
                      f"({time.time() - t0:.0f}s)", flush=True)
                if mae < best_mae:
                    best_mae = mae
                    torch.save(model.state_dict(), best_path)
            dist.barrier()

    # held-out season: single pass on rank 0 with the best weights
    if rank == 0:
        test_ds = TasselImages(args.root, test_df, args.crop, train=False)
        test_loader = DataLoader(test_ds, batch_size=1, num_workers=args.workers)
        test_net = TasselNetV2().to(device)
        test_net.load_state_dict(torch.load(best_path, map_location=device))
        test_net.eval()
        errs = []
        with torch.no_grad():
            for x, _, n in test_loader:
                errs.append((image_counts(test_net(x.to(device))).item() - float(n)))
        errs = np.asarray(errs)
        print(f"test {args.test_season}: MAE {np.abs(errs).mean():.2f} RMSE {np.sqrt((errs ** 2).mean()):.2f} "
              f"n={len(errs)}", flush=True)
        pd.DataFrame({"image": test_df.image.values, "err": errs}).to_csv(
            os.path.join(args.save, f"test_{args.test_season}.csv"), index=False)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
