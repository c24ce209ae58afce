"""Land-cover segmentation on windows streamed from large PlanetScope-style 8-band scenes.

Windows are read directly from the scene GeoTIFFs (internally tiled, 512 px
blocks) and moved to the GPU right away, where normalisation and the
photometric augmentation run; the per-band statistics are also computed on
the GPU from a random subsample of every scene.

    torchrun --nproc_per_node=8 14_multispectral_tile_stream.py \
        --scene-list /nfs/ps8b/scenes_train.txt --val-list /nfs/ps8b/scenes_val.txt
"""
import argparse
import math
import os

import numpy as np
import rasterio
from rasterio.windows import Window
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import segmentation_models_pytorch as smp

NUM_CLASSES = 7
IGNORE = 0        # label 0 = unlabelled, classes are 1..7 -> shifted to 0..6
WIN = 384


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--scene-list", required=True)
    p.add_argument("--val-list", required=True)
    p.add_argument("--out", default="/nfs/ps8b/runs/deeplabv3p")
    p.add_argument("--windows-per-scene", type=int, default=256)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


def read_list(path):
    with open(path) as f:
        return [l.strip() for l in f if l.strip()]


def window_index(scenes, per_scene, seed):
    rng = np.random.default_rng(seed)
    out = []
    for s, path in enumerate(scenes):
        with rasterio.open(path) as src:
            h, w = src.height, src.width
        ys = rng.integers(0, h - WIN, per_scene)
        xs = rng.integers(0, w - WIN, per_scene)
        out += [(s, int(y), int(x)) for y, x in zip(ys, xs)]
    return out


@torch.no_grad()
def gpu_band_sums(scenes, device, n_pix=100_000):
    """Per-band sum, sum of squares and pixel count over a subsample of each scene."""
    acc = torch.zeros(2, 8, device=device, dtype=torch.float64)
    count = torch.zeros(1, device=device, dtype=torch.float64)
    for path in scenes:
        with rasterio.open(path) as src:
            arr = src.read(out_shape=(src.count, src.height // 10, src.width // 10))
        t = torch.from_numpy(arr.astype(np.float32)).to(device).flatten(1)
        t = t[:, (t > 0).all(0)]
        if t.shape[1] > n_pix:
            t = t[:, torch.randperm(t.shape[1], device=device)[:n_pix]]
        acc[0] += t.double().sum(1)
        acc[1] += t.double().pow(2).sum(1)
        count += t.shape[1]
    return acc, count


class SceneWindows(Dataset):
    def __init__(self, scenes, windows, mean, std, augment):
        self.scenes, self.windows, self.augment = scenes, windows, augment
        self.device = mean.device
        self.mean = mean.view(-1, 1, 1)
        self.std = std.view(-1, 1, 1)

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        s, y, x = self.windows[i]
        path = self.scenes[s]
        with rasterio.open(path) as src:
            img = src.read(window=Window(x, y, WIN, WIN))
        with rasterio.open(path.replace("_AnalyticMS_SR_8b.tif", "_labels.tif")) as src:
            lbl = src.read(1, window=Window(x, y, WIN, WIN))
        img = torch.from_numpy(img.astype(np.float32)).to(self.device, non_blocking=True)
        lbl = torch.from_numpy(lbl.astype(np.int64)).to(self.device, non_blocking=True) - 1
        lbl[lbl < 0] = -100
        img = (img - self.mean) / self.std
        if self.augment:
            k = int(torch.randint(4, (1,)))
            img, lbl = torch.rot90(img, k, (1, 2)), torch.rot90(lbl, k, (0, 1))
            if torch.rand(1).item() < 0.5:
                img, lbl = img.flip(2), lbl.flip(1)
            gain = 1 + 0.1 * torch.randn(img.shape[0], 1, 1, device=self.device)
            img = img * gain
        return img, lbl


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_scenes = read_list(args.scene_list)
    val_scenes = read_list(args.val_list)
    # every rank reads its share of the scenes, the sums are combined across ranks
    acc, count = gpu_band_sums(train_scenes[rank::world], device)
    dist.all_reduce(acc)
    dist.all_reduce(count)
    mean = acc[0] / count
    std = (acc[1] / count - mean ** 2).sqrt()
    mean, std = mean.float(), std.float()

    train_windows = window_index(train_scenes, args.windows_per_scene, seed=0)
    val_windows = window_index(val_scenes, 32, seed=1)
    train_ds = SceneWindows(train_scenes, train_windows, mean, std, augment=True)
    val_ds = SceneWindows(val_scenes, val_windows, mean, std, augment=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                          num_workers=args.workers, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                        batch_size=args.batch_size, num_workers=args.workers)

    torch.manual_seed(0)
    model = smp.DeepLabV3Plus("resnet101", encoder_weights=None, in_channels=8, classes=NUM_CLASSES)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * math.sqrt(world * args.batch_size / 12)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=args.epochs * len(train_dl), power=0.9)
    crit = nn.CrossEntropyLoss(ignore_index=-100)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (img, lbl) in enumerate(train_dl):
            loss = crit(model(img), lbl)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)

        model.module.eval()
        cm = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long, device=device)
        with torch.no_grad():
            for img, lbl in val_dl:
                pred = model.module(img).argmax(1)
                ok = lbl >= 0
                cm += torch.bincount(lbl[ok] * NUM_CLASSES + pred[ok],
                                     minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES)
        dist.all_reduce(cm)
        iou = cm.diag() / (cm.sum(0) + cm.sum(1) - cm.diag()).clamp(min=1)
        if rank == 0:
            print(f"epoch {epoch} mIoU {iou.float().mean():.4f} per-class {iou.tolist()}", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict(),
                        "mean": mean.cpu(), "std": std.cpu()}, os.path.join(args.out, "last.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
