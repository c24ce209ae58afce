"""Hippocampus head/body segmentation (MSD Task04) with UNet++ and deep supervision, DDP.

    torchrun --nproc_per_node=2 20_hippocampus_unetpp.py --data_dir /data/Task04_Hippocampus --fold 0
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from sklearn.model_selection import KFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from monai.data import CacheDataset, DataLoader
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.networks.nets import BasicUNetPlusPlus
from monai.transforms import (
    Compose,
    EnsureChannelFirstd,
    LoadImaged,
    NormalizeIntensityd,
    RandAffined,
    RandCropByPosNegLabeld,
    RandFlipd,
    RandGaussianNoised,
    RandScaleIntensityd,
    SpatialPadd,
)

PATCH = (48, 64, 48)
log = logging.getLogger("hippo")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--val_interval", type=int, default=5)
    ap.add_argument("--output", default="runs/hippocampus_unetpp")
    ap.add_argument("--resume", default="")
    return ap.parse_args()


def datalists(data_dir, fold):
    with open(os.path.join(data_dir, "dataset.json")) as f:
        tr = sorted(json.load(f)["training"], key=lambda d: d["image"])
    items = [{"image": os.path.join(data_dir, d["image"]), "label": os.path.join(data_dir, d["label"])} for d in tr]
    train_idx, val_idx = list(KFold(n_splits=5, shuffle=True, random_state=12345).split(items))[fold]
    return [items[i] for i in train_idx], [items[i] for i in val_idx]


def transforms():
    base = [LoadImaged(keys=["image", "label"]), EnsureChannelFirstd(keys=["image", "label"]),
            NormalizeIntensityd(keys="image", nonzero=False)]
    train = Compose(base + [
        SpatialPadd(keys=["image", "label"], spatial_size=PATCH),
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=PATCH,
                               pos=1, neg=1, num_samples=1),
        RandAffined(keys=["image", "label"], prob=0.2, rotate_range=(0.5, 0.5, 0.5), scale_range=(0.15, 0.15, 0.15),
                    mode=("bilinear", "nearest")),
        RandGaussianNoised(keys="image", prob=0.1, std=0.1),
        RandScaleIntensityd(keys="image", factors=0.25, prob=0.15),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=1),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=2),
    ])
    return train, Compose(base)


def train_one_epoch(model, loader, loss_fn, opt, scaler, device):
    model.train()
    acc = torch.zeros(2, device=device)
    for batch in loader:
        x, y = batch["image"].to(device, non_blocking=True), batch["label"].to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            outs = model(x)  # deep supervision: 4 full-resolution outputs, last one is the final
            loss = sum(loss_fn(o, y) for o in outs) / len(outs)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 12.0)
        scaler.step(opt)
        scaler.update()
        acc += torch.stack([loss.detach().float(), torch.ones((), device=device)])
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item()


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    out = torch.zeros(2, 2, device=device)  # [dice sum, count] x [anterior, posterior]
    predictor = lambda t: net(t)[-1]
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = sliding_window_inference(batch["image"].to(device), PATCH, 8, predictor, overlap=0.5,
                                              mode="gaussian")
        pred, gt = logits.argmax(1)[0], batch["label"][0, 0].to(device)
        for c in (1, 2):
            p, g = pred == c, gt == c
            if g.any():
                out[0, c - 1] += 2 * (p & g).sum() / (p.sum() + g.sum())
                out[1, c - 1] += 1
    net.train()
    dist.all_reduce(out)
    return (out[0] / out[1].clamp(min=1)).tolist()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    train_files, val_files = datalists(args.data_dir, args.fold)
    train_tf, val_tf = transforms()
    # hippocampus volumes are tiny, caching the whole training set in RAM is cheap
    train_ds = CacheDataset(train_files, train_tf, cache_rate=1.0, num_workers=4, progress=False)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                              pin_memory=True)
    val_ds = CacheDataset(val_files[rank::world], val_tf, cache_rate=1.0, num_workers=2, progress=False)
    val_loader = DataLoader(val_ds, batch_size=1, num_workers=0)

    net = BasicUNetPlusPlus(spatial_dims=3, in_channels=1, out_channels=3, features=(32, 32, 64, 128, 256, 32),
                            deep_supervision=True, norm=("instance", {"affine": True})).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.99, nesterov=True, weight_decay=3e-5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: (1 - e / args.epochs) ** 0.9)
    scaler = torch.cuda.amp.GradScaler()
    start, best = 0, -1.0
    if args.resume:
        ck = torch.load(args.resume, map_location=device)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start, best = ck["epoch"] + 1, ck["best"]
    model = DDP(net, device_ids=[local_rank])
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, batch=True)
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)

    for epoch in range(start, args.epochs):
        t0 = time.time()
        loss = train_one_epoch(model, train_loader, loss_fn, opt, scaler, device)
        sched.step()
        log.info(f"epoch {epoch} loss {loss:.4f} lr {sched.get_last_lr()[0]:.5f} ({time.time() - t0:.1f}s)")
        if (epoch + 1) % args.val_interval == 0:
            ant, post = evaluate(net, val_loader, device)
            mean = (ant + post) / 2
            log.info(f"  val anterior {ant:.4f} posterior {post:.4f} mean {mean:.4f}")
            if rank == 0 and mean > best:
                best = mean
                torch.save({"model": net.state_dict(), "epoch": epoch, "best": best},
                           os.path.join(args.output, f"fold{args.fold}_best.pt"))
        if rank == 0:
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best": best}, os.path.join(args.output, f"fold{args.fold}_last.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
