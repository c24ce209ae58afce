"""Optical + SAR fusion for land-cover segmentation (SEN12MS-like triplets).

Every sample is a 256x256 Sentinel-2 patch (13 bands), the Sentinel-1 VV/VH
patch from the closest acquisition and a MODIS-IGBP derived label.  Some S2
patches have no S1 acquisition within the allowed time gap; for those the SAR
stack is zero and `s1_valid` is False.

    torchrun --nproc_per_node=8 06_sen12_fusion_seg.py --index /lustre/sen12/index.csv
"""
import argparse
import csv
import math
import os

import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
import timm

IGBP_TO_DFC = {1: 0, 2: 0, 3: 0, 4: 0, 5: 0, 6: 1, 7: 1, 8: 2, 9: 2, 10: 3,
               11: 4, 12: 5, 13: 6, 14: 5, 15: 7, 16: 8, 17: 9}
NUM_CLASSES = 10
IGNORE = 255


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--index", required=True, help="csv: s2_path,s1_path,label_path,split")
    p.add_argument("--logdir", default="/lustre/sen12/runs/fusion")
    p.add_argument("--backbone", default="resnet50")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=24)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


class SEN12Triplets(Dataset):
    def __init__(self, rows, train):
        self.rows, self.train = rows, train

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        with rasterio.open(r["s2_path"]) as src:
            s2 = src.read().astype(np.float32) / 10000.0
        if r["s1_path"]:
            with rasterio.open(r["s1_path"]) as src:
                s1 = src.read().astype(np.float32)
            s1 = (np.clip(s1, -25, 0) + 25) / 25          # dB -> [0, 1]
            s1_valid = True
        else:
            s1 = np.zeros((2,) + s2.shape[1:], np.float32)
            s1_valid = False
        with rasterio.open(r["label_path"]) as src:
            igbp = src.read(1)
        lbl = np.full(igbp.shape, IGNORE, np.int64)
        for k, v in IGBP_TO_DFC.items():
            lbl[igbp == k] = v
        if self.train and np.random.rand() < 0.5:
            s2, s1, lbl = s2[..., ::-1], s1[..., ::-1], lbl[..., ::-1]
        return (torch.from_numpy(s2.copy()), torch.from_numpy(s1.copy()),
                torch.tensor(s1_valid), torch.from_numpy(lbl.copy()))


class FusionNet(nn.Module):
    def __init__(self, backbone, num_classes):
        super().__init__()
        self.optical = timm.create_model(backbone, pretrained=False, in_chans=13,
                                         features_only=True, out_indices=(1, 2, 3))
        self.sar = timm.create_model("resnet18", pretrained=False, in_chans=2,
                                     features_only=True, out_indices=(1, 2, 3))
        oc = self.optical.feature_info.channels()
        sc = self.sar.feature_info.channels()
        self.gates = nn.ModuleList([nn.Sequential(nn.Conv2d(s, o, 1), nn.Sigmoid())
                                    for o, s in zip(oc, sc)])
        self.sar_proj = nn.ModuleList([nn.Conv2d(s, o, 1) for o, s in zip(oc, sc)])
        self.decoder = nn.ModuleList([nn.Conv2d(c, 128, 3, padding=1) for c in oc])
        self.head = nn.Sequential(nn.Conv2d(128 * 3, 128, 3, padding=1), nn.BatchNorm2d(128),
                                  nn.ReLU(inplace=True), nn.Conv2d(128, num_classes, 1))

    def forward(self, s2, s1, s1_valid):
        feats = self.optical(s2)
        if s1_valid.any():
            sfeats = self.sar(s1)
            m = s1_valid.float().view(-1, 1, 1, 1)
            feats = [f + m * g(s) * p(s) for f, s, g, p in
                     zip(feats, sfeats, self.gates, self.sar_proj)]
        size = feats[0].shape[-2:]
        x = torch.cat([F.interpolate(d(f), size=size, mode="bilinear", align_corners=False)
                       for d, f in zip(self.decoder, feats)], 1)
        return F.interpolate(self.head(x), size=s2.shape[-2:], mode="bilinear", align_corners=False)


def read_index(path):
    with open(path) as f:
        rows = list(csv.DictReader(f))
    train = [r for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "val"]
    return train, val


@torch.no_grad()
def run_validation(net, loader, device):
    net.eval()
    cm = torch.zeros(NUM_CLASSES, NUM_CLASSES, device=device, dtype=torch.int64)
    for s2, s1, v, lbl in loader:
        s2, s1, v, lbl = s2.to(device), s1.to(device), v.to(device), lbl.to(device)
        pred = net(s2, s1, v).argmax(1)
        ok = lbl != IGNORE
        cm += torch.bincount(lbl[ok] * NUM_CLASSES + pred[ok],
                             minlength=NUM_CLASSES * NUM_CLASSES).view(NUM_CLASSES, NUM_CLASSES)
    dist.all_reduce(cm)
    inter = cm.diag().double()
    union = cm.sum(0).double() + cm.sum(1).double() - inter
    present = cm.sum(1) > 0
    iou = inter / union.clamp(min=1)
    return iou, iou[present].mean().item(), (inter.sum() / cm.sum().clamp(min=1)).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(17)

    train_rows, val_rows = read_index(args.index)
    train_ds = SEN12Triplets(train_rows, train=True)
    val_ds = SEN12Triplets(val_rows, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)),
                        batch_size=args.batch_size, num_workers=args.workers)

    net = FusionNet(args.backbone, NUM_CLASSES)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])

    global_bs = args.batch_size * world
    lr = args.lr * global_bs / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    total_steps = args.epochs * len(train_dl)
    warmup = 500
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup
        else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total_steps - warmup))))
    crit = nn.CrossEntropyLoss(ignore_index=IGNORE)

    writer = SummaryWriter(args.logdir) if rank == 0 else None
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for s2, s1, v, lbl in train_dl:
            s2 = s2.to(device, non_blocking=True)
            s1 = s1.to(device, non_blocking=True)
            v = v.to(device, non_blocking=True)
            lbl = lbl.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = crit(model(s2, s1, v), lbl)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if writer is not None and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)

        iou, miou, oa = run_validation(net, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} mIoU {miou:.4f} OA {oa:.4f}", flush=True)
            writer.add_scalar("val/mIoU", miou, epoch)
            writer.add_scalar("val/OA", oa, epoch)
            for c in range(NUM_CLASSES):
                writer.add_scalar(f"val/iou_{c}", iou[c].item(), epoch)
            os.makedirs(args.logdir, exist_ok=True)
            torch.save({"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict()},
                       os.path.join(args.logdir, "checkpoint.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
