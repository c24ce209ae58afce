"""DRAEM: discriminatively trained reconstruction embedding for surface anomaly detection.

Multi-GPU training per MVTec category. Synthetic anomalies are made from Perlin-noise masks
filled with DTD textures; the reconstructive subnetwork learns to remove them and the
discriminative subnetwork segments them from the (input, reconstruction) pair.

Launch:
    torchrun --nproc_per_node=4 03_draem_train.py --category carpet --dtd_root /data/dtd/images
"""
import argparse
import glob
import math
import os
import random

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from kornia.losses import ssim_loss
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


# --------------------------------------------------------------------------- data

def perlin_2d(shape, res, rng):
    def fade(t):
        return 6 * t ** 5 - 15 * t ** 4 + 10 * t ** 3
    delta = (res[0] / shape[0], res[1] / shape[1])
    d = (shape[0] // res[0], shape[1] // res[1])
    grid = np.mgrid[0:res[0]:delta[0], 0:res[1]:delta[1]].transpose(1, 2, 0) % 1
    angles = 2 * math.pi * rng.random((res[0] + 1, res[1] + 1))
    grads = np.dstack((np.cos(angles), np.sin(angles)))
    tile = lambda s1, s2: np.repeat(np.repeat(grads[s1[0]:s1[1], s2[0]:s2[1]], d[0], 0), d[1], 1)
    dot = lambda g, s: (np.dstack((grid[:, :, 0] + s[0], grid[:, :, 1] + s[1])) * g[:shape[0], :shape[1]]).sum(2)
    n00 = dot(tile([0, -1], [0, -1]), [0, 0])
    n10 = dot(tile([1, None], [0, -1]), [-1, 0])
    n01 = dot(tile([0, -1], [1, None]), [0, -1])
    n11 = dot(tile([1, None], [1, None]), [-1, -1])
    t = fade(grid[:shape[0], :shape[1]])
    return math.sqrt(2) * ((n00 * (1 - t[..., 0]) + t[..., 0] * n10) * (1 - t[..., 1])
                           + t[..., 1] * ((n01 * (1 - t[..., 0]) + t[..., 0] * n11)))


class DRAEMTrainSet(Dataset):
    def __init__(self, root, category, dtd_root, size=256):
        self.images = sorted(glob.glob(os.path.join(root, category, "train", "good", "*.png")))
        self.textures = sorted(glob.glob(os.path.join(dtd_root, "*", "*.jpg")))
        self.size = size
        self.rng = np.random.default_rng()

    def __len__(self):
        return len(self.images)

    def _augment(self, img):
        rng = self.rng
        tex = cv2.imread(self.textures[rng.integers(len(self.textures))])
        tex = cv2.resize(cv2.cvtColor(tex, cv2.COLOR_BGR2RGB), (self.size, self.size)).astype(np.float32) / 255.0
        sx, sy = 2 ** rng.integers(0, 6), 2 ** rng.integers(0, 6)
        noise = perlin_2d((self.size, self.size), (sx, sy), rng)
        mask = (noise > 0.5).astype(np.float32)[..., None]
        beta = rng.random() * 0.8
        aug = img * (1 - mask) + (1 - beta) * tex * mask + beta * img * mask
        if rng.random() > 0.5 or mask.sum() == 0:
            return img, np.zeros_like(mask), 0.0
        return aug.astype(np.float32), mask, 1.0

    def __getitem__(self, idx):
        img = cv2.imread(self.images[idx])
        img = cv2.resize(cv2.cvtColor(img, cv2.COLOR_BGR2RGB), (self.size, self.size)).astype(np.float32) / 255.0
        if self.rng.random() > 0.7:
            img = np.rot90(img, k=self.rng.integers(1, 4)).copy()
        aug, mask, has_anomaly = self._augment(img)
        to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))
        return to_t(img), to_t(aug), to_t(mask), torch.tensor(has_anomaly)


def worker_init_fn(worker_id):
    info = torch.utils.data.get_worker_info()
    info.dataset.rng = np.random.default_rng(info.seed % 2 ** 32)


class MVTecTestSet(Dataset):
    def __init__(self, root, category, size=256):
        self.items = []
        for p in sorted(glob.glob(os.path.join(root, category, "test", "*", "*.png"))):
            defect = os.path.basename(os.path.dirname(p))
            gt = None if defect == "good" else os.path.join(root, category, "ground_truth", defect,
                                                           os.path.basename(p)[:-4] + "_mask.png")
            self.items.append((p, gt))
        self.size = size

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        p, gt = self.items[i]
        img = cv2.resize(cv2.cvtColor(cv2.imread(p), cv2.COLOR_BGR2RGB), (self.size, self.size))
        img = torch.from_numpy(img.astype(np.float32).transpose(2, 0, 1) / 255.0)
        if gt is None:
            mask = torch.zeros(1, self.size, self.size)
        else:
            m = cv2.resize(cv2.imread(gt, cv2.IMREAD_GRAYSCALE), (self.size, self.size), interpolation=cv2.INTER_NEAREST)
            mask = torch.from_numpy((m > 127).astype(np.float32))[None]
        return img, mask, int(gt is not None)


# -------------------------------------------------------------------------- model

def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class UNet(nn.Module):
    def __init__(self, cin, cout, base=64, depth=4):
        super().__init__()
        chs = [base * 2 ** i for i in range(depth + 1)]
        self.downs = nn.ModuleList([conv_block(cin, chs[0])] + [conv_block(chs[i], chs[i + 1]) for i in range(depth)])
        self.ups = nn.ModuleList([nn.ConvTranspose2d(chs[i + 1], chs[i], 2, stride=2) for i in reversed(range(depth))])
        self.decs = nn.ModuleList([conv_block(chs[i] * 2, chs[i]) for i in reversed(range(depth))])
        self.head = nn.Conv2d(chs[0], cout, 1)

    def forward(self, x):
        skips = []
        for i, down in enumerate(self.downs):
            x = down(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        skips.pop()
        for up, dec in zip(self.ups, self.decs):
            x = dec(torch.cat([up(x), skips.pop()], dim=1))
        return self.head(x)


class DRAEM(nn.Module):
    def __init__(self):
        super().__init__()
        self.reconstructive = UNet(3, 3, base=64, depth=4)
        self.discriminative = UNet(6, 2, base=32, depth=4)

    def forward(self, x):
        rec = torch.sigmoid(self.reconstructive(x))
        seg = self.discriminative(torch.cat([x, rec], dim=1))
        return rec, seg


def focal_loss(logits, target, gamma=2.0, alpha=0.75):
    target = target.long().squeeze(1)
    logp = F.log_softmax(logits, dim=1)
    logpt = logp.gather(1, target.unsqueeze(1)).squeeze(1)
    at = torch.where(target == 1, alpha, 1 - alpha)
    return (-at * (1 - logpt.exp()) ** gamma * logpt).mean()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    img_s, img_y, pix_s, pix_y = [], [], [], []
    for img, mask, y in loader:
        _, seg = model(img.to(device))
        prob = torch.softmax(seg, dim=1)[:, 1:]
        smooth = F.avg_pool2d(prob, 21, stride=1, padding=10)
        img_s.append(smooth.flatten(1).max(1).values.cpu())
        img_y.append(y)
        pix_s.append(prob.flatten().cpu())
        pix_y.append(mask.flatten())
    model.train()
    return (roc_auc_score(torch.cat(img_y).numpy(), torch.cat(img_s).numpy()),
            roc_auc_score(torch.cat(pix_y).numpy().astype(np.uint8), torch.cat(pix_s).numpy()))


# ---------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_root", default="/data/mvtec")
    ap.add_argument("--dtd_root", default="/data/dtd/images")
    ap.add_argument("--category", default="carpet")
    ap.add_argument("--epochs", type=int, default=700)
    ap.add_argument("--batch_size", type=int, default=8, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt_dir", default="checkpoints/draem")
    ap.add_argument("--resume", default="")
    ap.add_argument("--wandb_project", default="draem-mvtec")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # different augmentation streams per rank; the data split itself is owned by the sampler
    # (fixed seed) and DDP broadcasts rank 0's initial weights at construction
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    model = DRAEM().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(
        optimizer, milestones=[int(args.epochs * 0.8), int(args.epochs * 0.9)], gamma=0.2)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1

    train_set = DRAEMTrainSet(args.data_root, args.category, args.dtd_root)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, worker_init_fn=worker_init_fn,
                        persistent_workers=True)
    test_loader = DataLoader(MVTecTestSet(args.data_root, args.category), batch_size=16,
                             num_workers=args.workers)

    run = None
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        run = wandb.init(project=args.wandb_project, name=f"{args.category}-ws{world_size}", config=vars(args))

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        stats = torch.zeros(4, device=device)
        for img, aug, mask, _ in loader:
            img, aug, mask = img.to(device, non_blocking=True), aug.to(device), mask.to(device)
            rec, seg = model(aug)
            l2 = F.mse_loss(rec, img)
            ssim = ssim_loss(rec, img, window_size=11)
            seg_loss = focal_loss(seg, mask)
            loss = l2 + ssim + seg_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            stats += torch.stack([l2.detach(), ssim.detach(), seg_loss.detach(), torch.ones((), device=device)])
        scheduler.step()

        dist.all_reduce(stats)
        stats = (stats[:3] / stats[3]).tolist()
        if rank == 0:
            run.log({"loss/l2": stats[0], "loss/ssim": stats[1], "loss/focal": stats[2],
                     "lr": scheduler.get_last_lr()[0]}, step=epoch)
            if (epoch + 1) % 50 == 0 or epoch + 1 == args.epochs:
                img_auc, pix_auc = evaluate(model.module, test_loader, device)
                run.log({"auroc/image": img_auc, "auroc/pixel": pix_auc}, step=epoch)
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "epoch": epoch},
                           os.path.join(args.ckpt_dir, f"draem_{args.category}.pth"))
        dist.barrier()

    if rank == 0:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
