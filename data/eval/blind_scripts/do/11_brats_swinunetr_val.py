"""BraTS 2023 adult glioma - SwinUNETR, 5-fold CV, DDP.

Regions: TC (1+3), WT (1+2+3), ET (3).  Labels in the 2023 release use 3 for ET.

    torchrun --standalone --nproc_per_node=8 11_brats_swinunetr_val.py --fold 0 --data /data/BraTS2023
"""
import argparse
import glob
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from monai.data import DataLoader, Dataset, partition_dataset
from monai.inferers import sliding_window_inference
from monai.losses import DiceLoss
from monai.networks.nets import SwinUNETR
from monai.transforms import (
    Compose,
    CropForegroundd,
    EnsureTyped,
    LoadImaged,
    MapTransform,
    NormalizeIntensityd,
    RandFlipd,
    RandScaleIntensityd,
    RandShiftIntensityd,
    RandSpatialCropd,
    SpatialPadd,
)

MODALITIES = ["t1c", "t1n", "t2f", "t2w"]


class BratsRegionsd(MapTransform):
    """label map -> 3 binary channels (TC, WT, ET)"""

    def __call__(self, data):
        d = dict(data)
        for key in self.keys:
            lab = d[key]
            tc = (lab == 1) | (lab == 3)
            wt = (lab == 1) | (lab == 2) | (lab == 3)
            et = lab == 3
            d[key] = torch.cat([tc, wt, et], dim=0).float()
        return d


def case_list(root):
    cases = []
    for case_dir in sorted(glob.glob(os.path.join(root, "BraTS-GLI-*"))):
        cid = os.path.basename(case_dir)
        cases.append({
            "image": [os.path.join(case_dir, f"{cid}-{m}.nii.gz") for m in MODALITIES],
            "label": os.path.join(case_dir, f"{cid}-seg.nii.gz"),
        })
    return cases


def dice_coefficient(pred, gt):
    if gt.sum() == 0 and pred.sum() == 0:
        return 1.0
    return 2.0 * np.logical_and(pred, gt).sum() / (pred.sum() + gt.sum())


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/BraTS2023/ASNR-MICCAI-BraTS2023-GLI-Challenge-TrainingData")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--n_folds", type=int, default=5)
    p.add_argument("--save_dir", default="./swin_brats")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--roi", type=int, nargs=3, default=[128, 128, 128])
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--val_every", type=int, default=10)
    p.add_argument("--num_workers", type=int, default=6)
    return p.parse_args()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    cases = case_list(args.data)
    # deterministic interleaved folds over the sorted case list
    val_cases = cases[args.fold::args.n_folds]
    train_cases = [c for i, c in enumerate(cases) if i % args.n_folds != args.fold]

    train_tf = Compose([
        LoadImaged(keys=["image", "label"], ensure_channel_first=True, image_only=True),
        BratsRegionsd(keys="label"),
        CropForegroundd(keys=["image", "label"], source_key="image", k_divisible=list(args.roi)),
        RandSpatialCropd(keys=["image", "label"], roi_size=args.roi, random_size=False),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=1),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=2),
        NormalizeIntensityd(keys="image", nonzero=True, channel_wise=True),
        RandScaleIntensityd(keys="image", factors=0.1, prob=1.0),
        RandShiftIntensityd(keys="image", offsets=0.1, prob=1.0),
        EnsureTyped(keys=["image", "label"], track_meta=False),
    ])
    val_tf = Compose([
        LoadImaged(keys=["image", "label"], ensure_channel_first=True, image_only=True),
        BratsRegionsd(keys="label"),
        NormalizeIntensityd(keys="image", nonzero=True, channel_wise=True),
        EnsureTyped(keys=["image", "label"], track_meta=False),
    ])

    train_ds = Dataset(train_cases, transform=train_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True)
    my_val_cases = partition_dataset(val_cases, num_partitions=world_size, shuffle=False,
                                     even_divisible=False)[rank]
    val_loader = DataLoader(Dataset(my_val_cases, transform=val_tf), batch_size=1, num_workers=2)

    model = SwinUNETR(img_size=tuple(args.roi), in_channels=4, out_channels=3, feature_size=48,
                      drop_rate=0.0, attn_drop_rate=0.0, dropout_path_rate=0.0).to(device)
    model = DDP(model, device_ids=[local_rank])

    loss_fn = DiceLoss(to_onehot_y=False, sigmoid=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best_dice = 0.0

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t_start = time.time()
        running = torch.zeros(2, device=device)
        for batch in train_loader:
            image = batch["image"].to(device, non_blocking=True)
            label = batch["label"].to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(model(image), label)
            loss.backward()
            optimizer.step()
            running += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(running)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {(running[0] / running[1]).item():.4f} "
                  f"({time.time() - t_start:.0f}s)", flush=True)

        if (epoch + 1) % args.val_every != 0:
            continue

        model.eval()
        per_case = []
        with torch.no_grad():
            for batch in val_loader:
                image = batch["image"].to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = sliding_window_inference(image, args.roi, 4, model.module, overlap=0.6)
                pred = (torch.sigmoid(logits.float()) > 0.5).cpu().numpy()[0]
                gt = batch["label"].numpy()[0].astype(bool)
                per_case.append([dice_coefficient(pred[c], gt[c]) for c in range(3)])
        per_case = np.array(per_case)
        tc, wt, et = per_case.mean(axis=0)
        mean_dice = float(per_case.mean())

        if rank == 0:
            print(f"  val TC {tc:.4f} WT {wt:.4f} ET {et:.4f} mean {mean_dice:.4f}", flush=True)
            if mean_dice > best_dice:
                best_dice = mean_dice
                torch.save({"epoch": epoch + 1, "state_dict": model.module.state_dict(), "best_dice": best_dice},
                           os.path.join(args.save_dir, f"fold{args.fold}_best.pt"))
            torch.save({"epoch": epoch + 1, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                       os.path.join(args.save_dir, f"fold{args.fold}_last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
