"""AMOS22 abdominal multi-organ segmentation (15 organs, CT task) - SwinUNETR v2, DDP.

    torchrun --standalone --nproc_per_node=4 14_amos_multiorgan_swin.py --data_root /data/amos22
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from monai.data import CacheDataset, DataLoader, Dataset, decollate_batch, partition_dataset
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric
from monai.networks.nets import SwinUNETR
from monai.transforms import (
    AsDiscrete,
    Compose,
    CropForegroundd,
    EnsureChannelFirstd,
    EnsureTyped,
    LoadImaged,
    Orientationd,
    RandCropByLabelClassesd,
    RandFlipd,
    RandRotate90d,
    RandScaleIntensityd,
    RandShiftIntensityd,
    ScaleIntensityRanged,
    Spacingd,
)

NUM_CLASSES = 16
ROI = (96, 96, 96)

log = logging.getLogger("amos")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_root", default="/data/amos22")
    ap.add_argument("--out_dir", default="./amos_swin")
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--batch_size", type=int, default=1)
    ap.add_argument("--num_samples", type=int, default=4)
    ap.add_argument("--sw_batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--eval_num", type=int, default=25)
    ap.add_argument("--cache_rate", type=float, default=1.0)
    return ap.parse_args()


def load_amos_lists(root):
    with open(os.path.join(root, "dataset.json")) as f:
        meta = json.load(f)
    # CT only: ids < 500
    keep = lambda d: int(os.path.basename(d["image"]).split("_")[1][:4]) < 500
    fix = lambda d: {"image": os.path.join(root, d["image"]), "label": os.path.join(root, d["label"])}
    train = [fix(d) for d in meta["training"] if keep(d)]
    val = [fix(d) for d in meta["validation"] if keep(d)]
    return train, val


def transforms(num_samples):
    pre = [
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=(1.5, 1.5, 2.0), mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=-175, a_max=250, b_min=0.0, b_max=1.0, clip=True),
        CropForegroundd(keys=["image", "label"], source_key="image"),
        EnsureTyped(keys=["image", "label"]),
    ]
    aug = [
        RandCropByLabelClassesd(keys=["image", "label"], label_key="label", spatial_size=ROI,
                                num_classes=NUM_CLASSES, num_samples=num_samples),
        RandFlipd(keys=["image", "label"], prob=0.1, spatial_axis=0),
        RandFlipd(keys=["image", "label"], prob=0.1, spatial_axis=1),
        RandFlipd(keys=["image", "label"], prob=0.1, spatial_axis=2),
        RandRotate90d(keys=["image", "label"], prob=0.1, max_k=3),
        RandScaleIntensityd(keys="image", factors=0.1, prob=0.1),
        RandShiftIntensityd(keys="image", offsets=0.1, prob=0.1),
    ]
    return Compose(pre + aug), Compose(pre)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    train_files, val_files = load_amos_lists(args.data_root)
    train_tf, val_tf = transforms(args.num_samples)
    train_ds = CacheDataset(partition_dataset(train_files, num_partitions=world, shuffle=True, seed=0,
                                              even_divisible=True)[rank],
                            transform=train_tf, cache_rate=args.cache_rate, num_workers=8)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=4, pin_memory=True)
    val_ds = Dataset(partition_dataset(val_files, num_partitions=world, even_divisible=False)[rank], val_tf)
    val_loader = DataLoader(val_ds, batch_size=1, num_workers=4)
    log.info("%d train / %d val CT volumes, %d GPUs", len(train_files), len(val_files), world)

    net = SwinUNETR(img_size=ROI, in_channels=1, out_channels=NUM_CLASSES, feature_size=48,
                    use_v2=True).to(device)
    model = DDP(net, device_ids=[local_rank])
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler()
    dice_metric = DiceMetric(include_background=False, reduction="mean_batch", get_not_nans=False)
    post_label = AsDiscrete(to_onehot=NUM_CLASSES)
    post_pred = AsDiscrete(argmax=True, to_onehot=NUM_CLASSES)

    writer = SummaryWriter(os.path.join(args.out_dir, "tb")) if rank == 0 else None
    best = -1.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for batch in train_loader:
            x, y = batch["image"].to(device), batch["label"].to(device)
            with torch.cuda.amp.autocast():
                loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            acc += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(acc)
        if rank == 0:
            writer.add_scalar("train/loss", (acc[0] / acc[1]).item(), epoch)
            log.info("epoch %d loss %.4f %.0fs", epoch, (acc[0] / acc[1]).item(), time.time() - t0)

        if (epoch + 1) % args.eval_num == 0:
            net.eval()
            with torch.no_grad():
                for batch in val_loader:
                    img = batch["image"]
                    # AMOS volumes are large: run the windows on the GPU, stitch on the CPU
                    with torch.cuda.amp.autocast():
                        logits = sliding_window_inference(img, ROI, args.sw_batch_size, net, overlap=0.5,
                                                          mode="gaussian", sw_device="cuda:0", device="cpu")
                    dice_metric(y_pred=[post_pred(o) for o in decollate_batch(logits)],
                                y=[post_label(t) for t in decollate_batch(batch["label"])])
            organ_dice = dice_metric.aggregate().cpu().numpy()
            dice_metric.reset()
            mean_dice = float(np.nanmean(organ_dice))
            if rank == 0:
                writer.add_scalar("val/mean_dice", mean_dice, epoch)
                log.info("val mean dice %.4f | %s", mean_dice, np.round(organ_dice, 3).tolist())
                os.makedirs(args.out_dir, exist_ok=True)
                torch.save({"epoch": epoch, "model": net.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict()}, os.path.join(args.out_dir, "last.pt"))
                if mean_dice > best:
                    best = mean_dice
                    torch.save(net.state_dict(), os.path.join(args.out_dir, "best_metric_model.pt"))
            dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
