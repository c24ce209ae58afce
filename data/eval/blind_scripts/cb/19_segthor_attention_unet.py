"""SegTHOR thoracic organs at risk (esophagus, heart, trachea, aorta) -- Attention U-Net, DDP.

    torchrun --nnodes=1 --nproc_per_node=4 19_segthor_attention_unet.py --root /data/SegTHOR/train --fold 0
"""
import argparse
import glob
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from monai.data import DataLoader, Dataset
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.networks.nets import AttentionUnet
from monai.transforms import (
    Compose,
    EnsureChannelFirstd,
    LoadImaged,
    Orientationd,
    RandAdjustContrastd,
    RandCropByLabelClassesd,
    RandFlipd,
    RandZoomd,
    ScaleIntensityRanged,
    Spacingd,
    SpatialPadd,
)

ORGANS = ("esophagus", "heart", "trachea", "aorta")
ROI = (160, 160, 96)


def cases_for_fold(root, fold, n_folds=5):
    patients = sorted(os.path.basename(p) for p in glob.glob(os.path.join(root, "Patient_*")))
    items = [{"image": os.path.join(root, p, f"{p}.nii.gz"), "label": os.path.join(root, p, "GT.nii.gz")}
             for p in patients]
    val = [it for i, it in enumerate(items) if i % n_folds == fold]
    train = [it for i, it in enumerate(items) if i % n_folds != fold]
    return train, val


def get_transforms():
    pre = [
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=(0.98, 0.98, 2.5), mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=-500, a_max=500, b_min=0.0, b_max=1.0, clip=True),
    ]
    train = Compose(pre + [
        SpatialPadd(keys=["image", "label"], spatial_size=ROI),
        # crops centred on every organ, the tiny esophagus twice as often
        RandCropByLabelClassesd(keys=["image", "label"], label_key="label", spatial_size=ROI, num_classes=5,
                                ratios=[1, 2, 1, 1, 1], num_samples=2),
        RandZoomd(keys=["image", "label"], prob=0.2, min_zoom=0.9, max_zoom=1.1, mode=("trilinear", "nearest")),
        RandAdjustContrastd(keys="image", prob=0.2, gamma=(0.8, 1.2)),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
    ])
    return train, Compose(pre)


def save_checkpoint(path, model, opt, sched, epoch, best):
    torch.save({"epoch": epoch, "best": best, "model": model.module.state_dict(),
                "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--batch_size", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--val_every", type=int, default=10)
    ap.add_argument("--ckpt_dir", default="/shared/ckpt/segthor")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(message)s")
    log = logging.getLogger("segthor")

    train_items, val_items = cases_for_fold(args.root, args.fold)
    train_tf, val_tf = get_transforms()
    train_ds = Dataset(train_items, train_tf)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6, pin_memory=True)
    val_loader = DataLoader(Dataset(val_items[rank::world], val_tf), batch_size=1, num_workers=2)

    net = AttentionUnet(spatial_dims=3, in_channels=1, out_channels=5, channels=(32, 64, 128, 256),
                        strides=(2, 2, 2)).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=args.epochs, power=0.9)
    os.makedirs(args.ckpt_dir, exist_ok=True)
    last_path = os.path.join(args.ckpt_dir, f"fold{args.fold}_last.pt")
    start, best = 0, -1.0
    if args.resume and os.path.exists(last_path):
        ck = torch.load(last_path, map_location="cpu")
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        start, best = ck["epoch"] + 1, ck["best"]
        log.info(f"resuming at epoch {start}")
    model = DDP(net, device_ids=[local_rank])
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, batch=True)
    scaler = torch.cuda.amp.GradScaler()

    for epoch in range(start, args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        t0, acc = time.time(), torch.zeros(2, device=device)
        for batch in loader:
            x, y = batch["image"].to(device), batch["label"].to(device)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            acc += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(acc)
        log.info(f"epoch {epoch} loss {(acc[0] / acc[1]).item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                 f"{time.time() - t0:.0f}s")

        if (epoch + 1) % args.val_every == 0:
            model.eval()
            stats = torch.zeros(2, len(ORGANS), device=device)
            with torch.no_grad():
                for vb in val_loader:
                    with torch.autocast("cuda", dtype=torch.float16):
                        pred = sliding_window_inference(vb["image"].to(device), ROI, 4, model.module,
                                                        overlap=0.5, mode="gaussian").argmax(1)[0]
                    gt = vb["label"][0, 0].to(device)
                    for k in range(len(ORGANS)):
                        p, g = pred == k + 1, gt == k + 1
                        if g.any():
                            stats[0, k] += 2 * (p & g).sum() / (p.sum() + g.sum())
                            stats[1, k] += 1
            model.train()
            dist.all_reduce(stats)
            per_organ = (stats[0] / stats[1].clamp(min=1)).tolist()
            mean = sum(per_organ) / len(per_organ)
            log.info("val " + " ".join(f"{o} {d:.4f}" for o, d in zip(ORGANS, per_organ)) + f" mean {mean:.4f}")
            if mean > best:
                best = mean
                save_checkpoint(os.path.join(args.ckpt_dir, f"fold{args.fold}_best.pt"),
                                model, opt, sched, epoch, best)
        save_checkpoint(last_path, model, opt, sched, epoch, best)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
