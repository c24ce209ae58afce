"""KiTS-style kidney + tumour 3D segmentation, 5-fold CV with MONAI on one multi-GPU node.

- folds.json is written once (rank 0) and read by all ranks after a barrier
- training data is partitioned per rank (MONAI's partition_dataset + CacheDataset pattern)
- BatchNorm is converted to SyncBatchNorm (2 patches per GPU)
- validation runs on the plain module with uneven per-rank case lists

    torchrun --nproc_per_node=8 17_kits_3d_unet_cv.py --data-json /data/kits/dataset.json --out runs/kits_unet
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from monai.data import CacheDataset, DataLoader, Dataset, decollate_batch, partition_dataset
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric
from monai.transforms import (AsDiscrete, Compose, CropForegroundd, EnsureChannelFirstd, EnsureTyped,
                              LoadImaged, Orientationd, RandCropByPosNegLabeld, RandFlipd,
                              RandScaleIntensityd, ScaleIntensityRanged, Spacingd)
from sklearn.model_selection import KFold
from torch.nn.parallel import DistributedDataParallel as DDP

PATCH = (128, 128, 128)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-json", required=True)
    ap.add_argument("--out", default="runs/kits_unet")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--val-every", type=int, default=10)
    ap.add_argument("--bs", type=int, default=1, help="volumes per GPU; each yields 2 patches")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--cache-rate", type=float, default=1.0)
    return ap.parse_args()


def conv_block(cin, cout):
    return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm3d(cout), nn.LeakyReLU(0.01, True),
                         nn.Conv3d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm3d(cout), nn.LeakyReLU(0.01, True))


class UNet3D(nn.Module):
    def __init__(self, in_ch=1, n_cls=3, widths=(32, 64, 128, 256, 320)):
        super().__init__()
        self.enc = nn.ModuleList()
        c = in_ch
        for w in widths:
            self.enc.append(conv_block(c, w))
            c = w
        self.up = nn.ModuleList([nn.ConvTranspose3d(widths[i + 1], widths[i], 2, 2) for i in range(len(widths) - 1)])
        self.dec = nn.ModuleList([conv_block(2 * widths[i], widths[i]) for i in range(len(widths) - 1)])
        self.head = nn.Conv3d(widths[0], n_cls, 1)

    def forward(self, x):
        skips = []
        for i, blk in enumerate(self.enc):
            x = blk(x)
            if i < len(self.enc) - 1:
                skips.append(x)
                x = F.max_pool3d(x, 2)
        for i in reversed(range(len(self.dec))):
            x = self.dec[i](torch.cat([self.up[i](x), skips[i]], 1))
        return self.head(x)


def transforms(train):
    base = [
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=(1.0, 1.0, 1.0), mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys=["image"], a_min=-80, a_max=305, b_min=0.0, b_max=1.0, clip=True),
        CropForegroundd(keys=["image", "label"], source_key="image"),
    ]
    if train:
        base += [
            RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=PATCH, pos=2, neg=1,
                                   num_samples=2, image_key="image", allow_smaller=False),
            RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
            RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=1),
            RandScaleIntensityd(keys="image", factors=0.1, prob=0.5),
        ]
    return Compose(base + [EnsureTyped(keys=["image", "label"], track_meta=False)])


def make_folds(cases, n_folds, path):
    kf = KFold(n_splits=n_folds, shuffle=True, random_state=12345)
    folds = {}
    for f, (_, va) in enumerate(kf.split(cases)):
        for i in va:
            folds[cases[i]["case_id"]] = f
    with open(path, "w") as fh:
        json.dump(folds, fh, indent=1)


def validate(net, val_ds, device, world_size):
    post_pred, post_lbl = AsDiscrete(argmax=True, to_onehot=3), AsDiscrete(to_onehot=3)
    metric = DiceMetric(include_background=False, reduction="none")
    net.eval()
    local = []
    with torch.no_grad():
        for item in DataLoader(val_ds, batch_size=1, num_workers=2):
            img, lbl = item["image"].to(device), item["label"].to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = sliding_window_inference(img, PATCH, 4, net, overlap=0.5, mode="gaussian")
            preds = [post_pred(p) for p in decollate_batch(logits.float())]
            lbls = [post_lbl(l) for l in decollate_batch(lbl)]
            d = metric(y_pred=preds, y=lbls)  # (1, 2): kidney, tumour
            local.append((item["case_id"][0], d[0].cpu().numpy()))
    parts = [None] * world_size
    dist.all_gather_object(parts, local)  # shards are uneven: object gather handles that
    return dict(kv for p in parts for kv in p)


def run_fold(fold, cases, folds, args, rank, local_rank, world_size):
    device = torch.device("cuda", local_rank)
    tr_cases = [c for c in cases if folds[c["case_id"]] != fold]
    va_cases = [c for c in cases if folds[c["case_id"]] == fold]
    tr_part = partition_dataset(tr_cases, num_partitions=world_size, shuffle=True, seed=fold,
                                even_divisible=True)[rank]
    va_part = partition_dataset(va_cases, num_partitions=world_size, shuffle=False, even_divisible=False)[rank]
    tr_ds = CacheDataset(tr_part, transforms(True), cache_rate=args.cache_rate, num_workers=4,
                         progress=rank == 0)
    va_ds = Dataset(va_part, transforms(False))
    tr_dl = DataLoader(tr_ds, batch_size=args.bs, shuffle=True, num_workers=4, drop_last=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(UNet3D()).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=args.epochs, power=0.9)
    scaler = torch.cuda.amp.GradScaler()
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)

    best, best_cases = -1.0, None
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        ep_loss = torch.zeros(2, device=device)
        for batch in tr_dl:
            img, lbl = batch["image"].to(device), batch["label"].to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(img), lbl)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 12.0)
            scaler.step(opt)
            scaler.update()
            ep_loss += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(ep_loss)
        if rank == 0:
            print(f"fold {fold} ep {epoch} loss {(ep_loss[0] / ep_loss[1]).item():.4f} {time.time() - t0:.0f}s",
                  flush=True)

        if (epoch + 1) % args.val_every == 0 or epoch + 1 == args.epochs:
            per_case = validate(net, va_ds, device, world_size)
            score = float(np.mean([v.mean() for v in per_case.values()]))
            if rank == 0:
                print(f"  val dice (kidney/tumour avg) {score:.4f} over {len(per_case)} cases", flush=True)
                if score > best:
                    torch.save({"model": net.state_dict(), "epoch": epoch, "dice": score},
                               os.path.join(args.out, f"fold{fold}_best.pt"))
            if score > best:
                best, best_cases = score, per_case
    return best, best_cases


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.backends.cudnn.benchmark = True
    os.makedirs(args.out, exist_ok=True)

    with open(args.data_json) as fh:
        cases = json.load(fh)["training"]  # [{"image": ..., "label": ..., "case_id": ...}]
    folds_path = os.path.join(args.out, "folds.json")
    if rank == 0 and not os.path.exists(folds_path):
        make_folds(cases, args.folds, folds_path)
    dist.barrier(device_ids=[local_rank])
    with open(folds_path) as fh:
        folds = json.load(fh)

    summary = {}
    all_cases = {}
    for fold in range(args.folds):
        best, per_case = run_fold(fold, cases, folds, args, rank, local_rank, world_size)
        summary[fold] = best
        all_cases.update({k: v.tolist() for k, v in per_case.items()})
        torch.cuda.empty_cache()

    if rank == 0:
        print("best dice per fold", summary, "mean", np.mean(list(summary.values())))
        with open(os.path.join(args.out, "oof_case_dice.json"), "w") as fh:
            json.dump(all_cases, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
