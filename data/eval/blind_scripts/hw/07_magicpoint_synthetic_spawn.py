"""MagicPoint (SuperPoint detector) training on synthetic shapes, one process per GPU via mp.spawn.

    python 07_magicpoint_synthetic_spawn.py --gpus 4 --data_dir /scratch/synthetic_shapes --exp magicpoint_v2
"""
import argparse
import os
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

H, W = 120, 160


def draw_sample(rng):
    img = np.full((H, W), rng.integers(0, 100), np.uint8)
    img = cv2.GaussianBlur((img + rng.normal(0, 15, (H, W))).clip(0, 255).astype(np.uint8), (9, 9), 0)
    pts = []
    for _ in range(rng.integers(1, 5)):
        kind = rng.integers(0, 3)
        col = int(rng.integers(120, 256))
        if kind == 0:  # polygon
            n = rng.integers(3, 6)
            c = rng.uniform([20, 20], [W - 20, H - 20])
            ang = np.sort(rng.uniform(0, 2 * np.pi, n))
            rad = rng.uniform(10, 35, n)
            poly = (c + np.stack([np.cos(ang) * rad, np.sin(ang) * rad], 1)).astype(np.int32)
            cv2.fillPoly(img, [poly], col)
            pts += poly.tolist()
        elif kind == 1:  # line segment
            p0, p1 = rng.uniform([0, 0], [W, H], (2, 2)).astype(np.int32)
            cv2.line(img, tuple(map(int, p0)), tuple(map(int, p1)), col, int(rng.integers(1, 4)))
            pts += [p0.tolist(), p1.tolist()]
        else:  # star
            c = rng.uniform([25, 25], [W - 25, H - 25]).astype(np.int32)
            for _ in range(rng.integers(3, 6)):
                a, r = rng.uniform(0, 2 * np.pi), rng.uniform(10, 25)
                e = (c + r * np.array([np.cos(a), np.sin(a)])).astype(np.int32)
                cv2.line(img, tuple(map(int, c)), tuple(map(int, e)), col, 2)
                pts.append(e.tolist())
            pts.append(c.tolist())
    pts = np.array(pts, np.float32).reshape(-1, 2)
    ok = (pts[:, 0] >= 0) & (pts[:, 0] < W) & (pts[:, 1] >= 0) & (pts[:, 1] < H)
    return img, pts[ok]


def generate_split(path, n, seed):
    rng = np.random.default_rng(seed)
    imgs = np.zeros((n, H, W), np.uint8)
    heat = np.zeros((n, H, W), np.uint8)
    for i in range(n):
        img, pts = draw_sample(rng)
        imgs[i] = img
        p = np.round(pts).astype(int).clip([0, 0], [W - 1, H - 1])
        heat[i, p[:, 1], p[:, 0]] = 1
    tmp = path + ".tmp.npz"
    np.savez_compressed(tmp, images=imgs, heatmaps=heat)
    os.replace(tmp, path)


class ShapesDataset(Dataset):
    def __init__(self, path, augment):
        d = np.load(path)
        self.images, self.heatmaps = d["images"], d["heatmaps"]
        self.augment = augment

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = self.images[i].astype(np.float32) / 255.0
        if self.augment:
            img = np.clip(img * np.random.uniform(0.6, 1.4) + np.random.normal(0, 0.03, img.shape), 0, 1)
        return torch.from_numpy(img.astype(np.float32))[None], torch.from_numpy(self.heatmaps[i].astype(np.float32))


class MagicPoint(nn.Module):
    def __init__(self):
        super().__init__()

        def cbr(i, o):
            return [nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(inplace=True)]

        self.backbone = nn.Sequential(*cbr(1, 64), *cbr(64, 64), nn.MaxPool2d(2), *cbr(64, 64), *cbr(64, 64),
                                      nn.MaxPool2d(2), *cbr(64, 128), *cbr(128, 128), nn.MaxPool2d(2),
                                      *cbr(128, 128), *cbr(128, 128))
        self.head = nn.Sequential(*cbr(128, 256), nn.Conv2d(256, 65, 1))

    def forward(self, x):
        return self.head(self.backbone(x))


def cell_labels(heat):
    b = heat.size(0)
    lab = F.pixel_unshuffle(heat[:, None], 8)
    lab = torch.cat([2 * lab, torch.ones_like(lab[:, :1])], 1)
    return (lab + 0.1 * torch.rand_like(lab)).argmax(1)


def heatmap_from_logits(logits):
    prob = logits.softmax(1)[:, :-1]
    return F.pixel_shuffle(prob, 8)[:, 0]


def nms_points(prob, thr=0.015, radius=4):
    mx = F.max_pool2d(prob[:, None], 2 * radius + 1, 1, radius)[:, 0]
    return (prob == mx) & (prob > thr)


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    os.makedirs(args.data_dir, exist_ok=True)
    train_path = os.path.join(args.data_dir, f"shapes_train_{args.n_train}.npz")
    val_path = os.path.join(args.data_dir, f"shapes_val_{args.n_val}.npz")
    if rank == 0:
        if not os.path.exists(train_path):
            generate_split(train_path, args.n_train, seed=1)
        if not os.path.exists(val_path):
            generate_split(val_path, args.n_val, seed=2)
    dist.barrier()

    train_set, val_set = ShapesDataset(train_path, True), ShapesDataset(val_path, False)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=64, sampler=val_sampler, num_workers=2)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(MagicPoint()).to(device)
    model = DDP(model, device_ids=[rank], output_device=rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    exp_dir = os.path.join(args.out_dir, args.exp)
    ckpt_path = os.path.join(exp_dir, "last.pt")
    start_epoch = 0
    if args.resume and os.path.isfile(ckpt_path):
        state = torch.load(ckpt_path, map_location={"cuda:0": f"cuda:{rank}"})
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
        if rank == 0:
            print(f"resumed from epoch {state['epoch']}")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for img, heat in train_loader:
            img, heat = img.to(device, non_blocking=True), heat.to(device, non_blocking=True)
            loss = F.cross_entropy(model(img), cell_labels(heat))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach() * img.size(0), torch.tensor(float(img.size(0)), device=device)])

        # detection precision / recall at 2px tolerance, summed over all ranks
        model.eval()
        stats = torch.zeros(3, device=device)  # tp, n_pred, n_gt
        with torch.no_grad():
            for img, heat in val_loader:
                img, heat = img.to(device), heat.to(device)
                pred = nms_points(heatmap_from_logits(model(img)))
                near_gt = F.max_pool2d(heat[:, None], 5, 1, 2)[:, 0] > 0
                stats += torch.stack([(pred & near_gt).sum(), pred.sum(), heat.sum()]).float()
        dist.all_reduce(loss_sum)
        dist.all_reduce(stats)

        if rank == 0:
            precision = (stats[0] / stats[1].clamp(min=1)).item()
            recall = (stats[0] / stats[2].clamp(min=1)).item()
            print(f"epoch {epoch:3d} loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"P {precision:.3f} R {recall:.3f} ({time.time() - t0:.0f}s)", flush=True)
            os.makedirs(exp_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--data_dir", default="data/synthetic_shapes")
    parser.add_argument("--out_dir", default="experiments")
    parser.add_argument("--exp", default="magicpoint")
    parser.add_argument("--n_train", type=int, default=100000)
    parser.add_argument("--n_val", type=int, default=2000)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
