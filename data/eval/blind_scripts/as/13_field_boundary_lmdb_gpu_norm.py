"""
Agricultural field extent + boundary segmentation (ResUNet-a style multitask)
on Sentinel-2 10 m bands (B2, B3, B4, B8) stored as uint16 patches in LMDB.

Normalisation runs on the GPU, after the uint16 batch has been transferred,
which keeps the DataLoader workers cheap.

    torchrun --nproc_per_node=4 train_fields.py --lmdb /data/fields/train.lmdb --val-lmdb /data/fields/val.lmdb
"""
import argparse
import os
import pickle

import lmdb
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import segmentation_models_pytorch as smp

# Sentinel-2 L2A reflectance statistics over the training AOIs (B2, B3, B4, B8)
BAND_MEAN = torch.tensor([452.1, 701.6, 742.9, 2731.4]).view(1, 4, 1, 1).cuda()
BAND_STD = torch.tensor([312.8, 356.2, 498.0, 891.7]).view(1, 4, 1, 1).cuda()


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lmdb", required=True)
    ap.add_argument("--val-lmdb", required=True)
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--w-boundary", type=float, default=1.0)
    ap.add_argument("--w-distance", type=float, default=0.5)
    ap.add_argument("--out", default="runs/fields_resunet")
    return ap.parse_args()


class LmdbPatches(Dataset):
    """key -> pickle((img uint16 [4,256,256], extent uint8, boundary uint8, distance float16))"""

    def __init__(self, path, augment=False):
        self.path = path
        self.augment = augment
        env = lmdb.open(path, readonly=True, lock=False, readahead=False)
        with env.begin() as txn:
            self.keys = pickle.loads(txn.get(b"__keys__"))
        env.close()
        self.env = None

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, i):
        if self.env is None:
            self.env = lmdb.open(self.path, readonly=True, lock=False, readahead=False, max_readers=256)
        with self.env.begin() as txn:
            img, ext, bnd, dst = pickle.loads(txn.get(self.keys[i]))
        img = img.astype(np.int32)
        if self.augment:
            k = np.random.randint(4)
            img, ext, bnd, dst = (np.rot90(a, k, axes=(-2, -1)) for a in (img, ext, bnd, dst))
            if np.random.rand() < 0.5:
                img, ext, bnd, dst = (a[..., ::-1] for a in (img, ext, bnd, dst))
        return (torch.from_numpy(np.ascontiguousarray(img)),
                torch.from_numpy(np.ascontiguousarray(ext)).float()[None],
                torch.from_numpy(np.ascontiguousarray(bnd)).float()[None],
                torch.from_numpy(np.ascontiguousarray(dst)).float()[None])


def normalize(x):
    return (x.float() - BAND_MEAN) / BAND_STD


class MultiTaskHead(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.base = base
        c = base.segmentation_head[0].in_channels
        self.base.segmentation_head = nn.Identity()
        self.extent = nn.Conv2d(c, 1, 1)
        self.boundary = nn.Conv2d(c, 1, 1)
        self.distance = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        f = self.base(x)
        return self.extent(f), self.boundary(f), torch.sigmoid(self.distance(f))


def tanimoto_loss(logits, target, eps=1e-5):
    p = torch.sigmoid(logits)
    num = (p * target).sum((1, 2, 3))
    den = (p ** 2 + target ** 2).sum((1, 2, 3)) - num
    return 1 - ((num + eps) / (den + eps)).mean()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    train_ds = LmdbPatches(args.lmdb, augment=True)
    val_ds = LmdbPatches(args.val_lmdb)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, args.batch_size, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=args.workers, pin_memory=True)

    base = smp.Unet("resnet34", encoder_weights=None, in_channels=4, classes=1)
    model = MultiTaskHead(base)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_dl))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for img, ext, bnd, dst in train_dl:
            img = normalize(img.to(device, non_blocking=True))
            ext, bnd, dst = ext.to(device), bnd.to(device), dst.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                p_ext, p_bnd, p_dst = model(img)
            loss = (tanimoto_loss(p_ext.float(), ext)
                    + args.w_boundary * tanimoto_loss(p_bnd.float(), bnd)
                    + args.w_distance * F.mse_loss(p_dst.float(), dst))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])

        model.eval()
        cnt = torch.zeros(4, device=device, dtype=torch.float64)  # extent tp, fp, fn ; boundary tp
        with torch.no_grad():
            for img, ext, bnd, _ in val_dl:
                img = normalize(img.to(device))
                ext, bnd = ext.to(device), bnd.to(device)
                p_ext, p_bnd, _ = model(img)
                pe = (p_ext > 0).double()
                cnt[0] += (pe * ext).sum()
                cnt[1] += (pe * (1 - ext)).sum()
                cnt[2] += ((1 - pe) * ext).sum()
                cnt[3] += ((p_bnd > 0).double() * bnd).sum() / bnd.sum().clamp(min=1) * img.shape[0]
        dist.all_reduce(cnt)
        dist.all_reduce(tot)
        f1 = (2 * cnt[0] / (2 * cnt[0] + cnt[1] + cnt[2]).clamp(min=1)).item()
        if rank == 0:
            print(f"epoch {epoch:02d} loss {(tot[0] / tot[1]).item():.4f} extent-F1 {f1:.4f}", flush=True)
            if f1 > best:
                best = f1
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "f1": f1,
                            "band_mean": BAND_MEAN.flatten().tolist(), "band_std": BAND_STD.flatten().tolist()},
                           os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
