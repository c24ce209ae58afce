"""BTCV multi-organ segmentation with SwinUNETR (self-supervised pretrained encoder), DDP.

torchrun --nproc_per_node=4 05_btcv_swinunetr_resume.py \
    --data_dir /data/btcv --json_list dataset_0.json \
    --pretrained ./pretrained/model_swinvit.pt --logdir runs/btcv_swin \
    --resume runs/btcv_swin/model_final.pt
"""
import argparse
import os
import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.parallel
from torch.cuda.amp import GradScaler, autocast
from torch.utils.tensorboard import SummaryWriter

from monai import data, transforms
from monai.data import decollate_batch, load_decathlon_datalist
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric
from monai.networks.nets import SwinUNETR
from monai.transforms import AsDiscrete
from monai.utils.enums import MetricReduction

parser = argparse.ArgumentParser(description="SwinUNETR BTCV")
parser.add_argument("--data_dir", default="/data/btcv", type=str)
parser.add_argument("--json_list", default="dataset_0.json", type=str)
parser.add_argument("--logdir", default="runs/btcv_swin", type=str)
parser.add_argument("--pretrained", default=None, type=str)
parser.add_argument("--resume", default=None, type=str)
parser.add_argument("--max_epochs", default=5000, type=int)
parser.add_argument("--val_every", default=100, type=int)
parser.add_argument("--batch_size", default=1, type=int)
parser.add_argument("--sw_batch_size", default=4, type=int)
parser.add_argument("--optim_lr", default=1e-4, type=float)
parser.add_argument("--reg_weight", default=1e-5, type=float)
parser.add_argument("--warmup_epochs", default=50, type=int)
parser.add_argument("--feature_size", default=48, type=int)
parser.add_argument("--roi", default=96, type=int)
parser.add_argument("--workers", default=8, type=int)
parser.add_argument("--infer_overlap", default=0.5, type=float)


class AverageMeter:
    def __init__(self):
        self.sum, self.count, self.avg = 0.0, 0, 0.0

    def update(self, val, n=1):
        self.sum += val * n
        self.count += n
        self.avg = self.sum / max(self.count, 1)


def get_loaders(args):
    roi = (args.roi,) * 3
    train_tf = transforms.Compose([
        transforms.LoadImaged(keys=["image", "label"]),
        transforms.EnsureChannelFirstd(keys=["image", "label"]),
        transforms.Orientationd(keys=["image", "label"], axcodes="RAS"),
        transforms.Spacingd(keys=["image", "label"], pixdim=(1.5, 1.5, 2.0), mode=("bilinear", "nearest")),
        transforms.ScaleIntensityRanged(keys="image", a_min=-175, a_max=250, b_min=0.0, b_max=1.0, clip=True),
        transforms.CropForegroundd(keys=["image", "label"], source_key="image"),
        transforms.RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=roi,
                                          pos=1, neg=1, num_samples=4, image_key="image", image_threshold=0),
        transforms.RandFlipd(keys=["image", "label"], prob=0.2, spatial_axis=0),
        transforms.RandFlipd(keys=["image", "label"], prob=0.2, spatial_axis=1),
        transforms.RandFlipd(keys=["image", "label"], prob=0.2, spatial_axis=2),
        transforms.RandRotate90d(keys=["image", "label"], prob=0.2, max_k=3),
        transforms.RandScaleIntensityd(keys="image", factors=0.1, prob=0.1),
        transforms.RandShiftIntensityd(keys="image", offsets=0.1, prob=0.1),
        transforms.ToTensord(keys=["image", "label"]),
    ])
    val_tf = transforms.Compose([
        transforms.LoadImaged(keys=["image", "label"]),
        transforms.EnsureChannelFirstd(keys=["image", "label"]),
        transforms.Orientationd(keys=["image", "label"], axcodes="RAS"),
        transforms.Spacingd(keys=["image", "label"], pixdim=(1.5, 1.5, 2.0), mode=("bilinear", "nearest")),
        transforms.ScaleIntensityRanged(keys="image", a_min=-175, a_max=250, b_min=0.0, b_max=1.0, clip=True),
        transforms.CropForegroundd(keys=["image", "label"], source_key="image"),
        transforms.ToTensord(keys=["image", "label"]),
    ])
    datalist_json = os.path.join(args.data_dir, args.json_list)
    train_files = load_decathlon_datalist(datalist_json, True, "training", base_dir=args.data_dir)
    val_files = load_decathlon_datalist(datalist_json, True, "validation", base_dir=args.data_dir)
    train_ds = data.CacheDataset(train_files, transform=train_tf, cache_num=24, cache_rate=1.0,
                                 num_workers=args.workers)
    val_ds = data.Dataset(val_files, transform=val_tf)
    train_sampler = data.DistributedSampler(train_ds, shuffle=True)
    val_sampler = data.DistributedSampler(val_ds, shuffle=False, even_divisible=False)
    train_loader = data.DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                                   num_workers=args.workers, pin_memory=True)
    val_loader = data.DataLoader(val_ds, batch_size=1, sampler=val_sampler, num_workers=args.workers,
                                 pin_memory=True)
    return train_loader, val_loader, train_sampler


def main():
    args = parser.parse_args()
    args.rank = int(os.environ["RANK"])
    args.world_size = int(os.environ["WORLD_SIZE"])
    args.gpu = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend="nccl", init_method="env://")
    torch.backends.cudnn.benchmark = True

    train_loader, val_loader, train_sampler = get_loaders(args)
    model = SwinUNETR(img_size=(args.roi,) * 3, in_channels=1, out_channels=14, feature_size=args.feature_size,
                      drop_rate=0.0, attn_drop_rate=0.0, dropout_path_rate=0.0)

    if args.pretrained:
        weights = torch.load(args.pretrained, map_location="cpu")
        model.load_from(weights=weights)
        if args.rank == 0:
            print(f"loaded self-supervised swinViT weights from {args.pretrained}")

    model.cuda(args.gpu)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.optim_lr, weight_decay=args.reg_weight)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.optim_lr, total_steps=args.max_epochs,
                                                    pct_start=args.warmup_epochs / args.max_epochs)
    scaler = GradScaler()

    start_epoch, best_acc = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        checkpoint = torch.load(args.resume)
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        scaler.load_state_dict(checkpoint["scaler"])
        start_epoch = checkpoint["epoch"] + 1
        best_acc = checkpoint["best_acc"]
        if args.rank == 0:
            print(f"=> resumed from {args.resume} (epoch {start_epoch}, best acc {best_acc:.4f})")

    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu], output_device=args.gpu)

    dice_loss = DiceCELoss(to_onehot_y=True, softmax=True, squared_pred=True, smooth_nr=0.0, smooth_dr=1e-6)
    post_label = AsDiscrete(to_onehot=14)
    post_pred = AsDiscrete(argmax=True, to_onehot=14)
    dice_acc = DiceMetric(include_background=True, reduction=MetricReduction.MEAN, get_not_nans=True)
    model_inferer = partial(sliding_window_inference, roi_size=(args.roi,) * 3, sw_batch_size=args.sw_batch_size,
                            predictor=model.module, overlap=args.infer_overlap)

    writer = None
    if args.rank == 0:
        os.makedirs(args.logdir, exist_ok=True)
        writer = SummaryWriter(log_dir=args.logdir)

    for epoch in range(start_epoch, args.max_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        meter = AverageMeter()
        t0 = time.time()
        for idx, batch in enumerate(train_loader):
            x, y = batch["image"].cuda(args.gpu), batch["label"].cuda(args.gpu)
            optimizer.zero_grad(set_to_none=True)
            with autocast():
                loss = dice_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            loss_t = loss.detach().clone()
            dist.all_reduce(loss_t)
            meter.update((loss_t / args.world_size).item(), n=args.batch_size)
        scheduler.step()
        if args.rank == 0:
            print(f"Epoch {epoch}/{args.max_epochs - 1} loss: {meter.avg:.4f} time {time.time() - t0:.2f}s")
            writer.add_scalar("train_loss", meter.avg, epoch)

        if (epoch + 1) % args.val_every == 0:
            model.eval()
            with torch.no_grad():
                for batch in val_loader:
                    x, y = batch["image"].cuda(args.gpu), batch["label"].cuda(args.gpu)
                    with autocast():
                        logits = model_inferer(x)
                    preds = [post_pred(t) for t in decollate_batch(logits)]
                    labels = [post_label(t) for t in decollate_batch(y)]
                    dice_acc(y_pred=preds, y=labels)
            acc, not_nans = dice_acc.aggregate()
            dice_acc.reset()
            val_avg_acc = float(np.mean(acc.cpu().numpy()))
            if args.rank == 0:
                print(f"Final validation {epoch} acc {val_avg_acc:.4f}")
                writer.add_scalar("val_acc", val_avg_acc, epoch)
                state = {"epoch": epoch, "best_acc": max(best_acc, val_avg_acc),
                         "state_dict": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict()}
                torch.save(state, os.path.join(args.logdir, "model_final.pt"))
                if val_avg_acc > best_acc:
                    print(f"new best ({best_acc:.6f} --> {val_avg_acc:.6f})")
                    torch.save(state, os.path.join(args.logdir, "model.pt"))
            best_acc = max(best_acc, val_avg_acc)
            dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
