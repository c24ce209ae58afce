"""Bi-temporal change detection on 0.3 m aerial orthophotos (SYSU-CD / in-house 2019-2023 pairs).

Shared ResNet-50 backbone for both dates + temporal attention fusion + FPN head.
512x512 crops of both dates with a ResNet-50 do not fit in memory at batch 8, so the
backbone stages are recomputed in the backward pass (activation checkpointing).

    torchrun --nproc_per_node=8 02_sysu_cd_siam_r50.py --data /data/sysu_cd --bs 8
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("cd")


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--work-dir", default="work_dirs/siam_r50_tafpn")
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--grad-ckpt", action="store_true", default=True)
    p.add_argument("--val-interval", type=int, default=5)
    return p


class PairFolder(Dataset):
    def __init__(self, root, split, train):
        self.dir = os.path.join(root, split)
        self.names = sorted(os.listdir(os.path.join(self.dir, "time1")))
        self.train = train
        self.mean = np.array([123.7, 116.3, 103.5], np.float32)
        self.std = np.array([58.4, 57.1, 57.4], np.float32)

    def __len__(self):
        return len(self.names)

    def _img(self, sub, n):
        x = np.asarray(Image.open(os.path.join(self.dir, sub, n)).convert("RGB"), np.float32)
        return (x - self.mean) / self.std

    def __getitem__(self, i):
        n = self.names[i]
        a, b = self._img("time1", n), self._img("time2", n)
        y = (np.asarray(Image.open(os.path.join(self.dir, "label", n)).convert("L")) > 127).astype(np.int64)
        if self.train:
            if np.random.rand() < 0.5:
                a, b, y = a[:, ::-1], b[:, ::-1], y[:, ::-1]
            if np.random.rand() < 0.5:
                a, b, y = a[::-1], b[::-1], y[::-1]
            if np.random.rand() < 0.5:
                a, b = b, a
        t = lambda z: torch.from_numpy(np.ascontiguousarray(z.transpose(2, 0, 1)))
        return t(a), t(b), torch.from_numpy(np.ascontiguousarray(y))


class TemporalAttentionFusion(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate = nn.Sequential(nn.Conv2d(2 * c, c, 1), nn.BatchNorm2d(c), nn.ReLU(True), nn.Conv2d(c, 2, 1))
        self.proj = nn.Conv2d(c, 128, 1)

    def forward(self, fa, fb):
        w = self.gate(torch.cat([fa, fb], 1)).softmax(1)
        return self.proj(torch.abs(fa * w[:, :1] - fb * w[:, 1:]))


class SiamR50TAFPN(nn.Module):
    def __init__(self, use_ckpt=True):
        super().__init__()
        r = torchvision.models.resnet50(weights=torchvision.models.ResNet50_Weights.IMAGENET1K_V2)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.stages = nn.ModuleList([r.layer1, r.layer2, r.layer3, r.layer4])
        self.fuse = nn.ModuleList([TemporalAttentionFusion(c) for c in (256, 512, 1024, 2048)])
        self.smooth = nn.Sequential(nn.Conv2d(128, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(True))
        self.cls = nn.Conv2d(128, 2, 1)
        self.use_ckpt = use_ckpt

    def extract(self, x):
        x = self.stem(x)
        feats = []
        for stage in self.stages:
            if self.use_ckpt and self.training:
                x = checkpoint(stage, x, use_reentrant=True)
            else:
                x = stage(x)
            feats.append(x)
        return feats

    def forward(self, a, b):
        size = a.shape[-2:]
        fa, fb = self.extract(a), self.extract(b)
        fused = [f(x, y) for f, x, y in zip(self.fuse, fa, fb)]
        out = fused[-1]
        for lower in reversed(fused[:-1]):
            out = lower + F.interpolate(out, size=lower.shape[-2:], mode="bilinear", align_corners=False)
        out = self.cls(self.smooth(out))
        return F.interpolate(out, size=size, mode="bilinear", align_corners=False)


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    for a, b, y in loader:
        a, b, y = a.to(device), b.to(device), y.to(device)
        pred = net(a, b).argmax(1)
        s += torch.stack([((pred == 1) & (y == 1)).sum(), ((pred == 1) & (y == 0)).sum(),
                          ((pred == 0) & (y == 1)).sum()]).double()
    dist.all_reduce(s)
    net.train()
    tp, fp, fn = s.tolist()
    return {"f1": 2 * tp / max(2 * tp + fp + fn, 1), "iou": tp / max(tp + fp + fn, 1)}


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN, format="%(asctime)s - %(message)s")

    train_ds = PairFolder(args.data, "train", train=True)
    val_ds = PairFolder(args.data, "val", train=False)
    val_ds.names = val_ds.names[rank::world]
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=16, shuffle=False, num_workers=4)

    model = SiamR50TAFPN(use_ckpt=args.grad_ckpt)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    backbone = [p for n, p in model.module.named_parameters() if n.startswith(("stem", "stages"))]
    head = [p for n, p in model.module.named_parameters() if not n.startswith(("stem", "stages"))]
    opt = torch.optim.AdamW([{"params": backbone, "lr": args.lr * 0.1}, {"params": head}],
                            lr=args.lr, weight_decay=0.01)
    iters = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[args.lr * 0.1, args.lr], total_steps=iters, pct_start=0.05)
    crit = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 4.0], device=device))

    os.makedirs(args.work_dir, exist_ok=True)
    best_f1 = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for it, (a, b, y) in enumerate(train_dl):
            a, b, y = a.to(device, non_blocking=True), b.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = crit(model(a, b).float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
            if it % 50 == 0:
                logger.info("epoch %d iter %d/%d loss %.4f", epoch, it, len(train_dl), loss.item())
        dist.all_reduce(acc)
        logger.info("epoch %d mean loss %.4f (%.0fs)", epoch, (acc[0] / acc[1]).item(), time.time() - t0)

        if (epoch + 1) % args.val_interval == 0:
            m = validate(model.module, val_dl, device)
            logger.info("val F1 %.4f IoU %.4f", m["f1"], m["iou"])
            if rank == 0 and m["f1"] > best_f1:
                best_f1 = m["f1"]
                torch.save({"state_dict": model.module.state_dict(), "epoch": epoch, **m},
                           os.path.join(args.work_dir, "best_f1.pth"))

    if rank == 0:
        torch.save({"state_dict": model.module.state_dict(), "epoch": args.epochs - 1},
                   os.path.join(args.work_dir, "latest.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
