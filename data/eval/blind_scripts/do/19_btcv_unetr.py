"""BTCV multi-organ (13 abdominal organs) segmentation with UNETR, DDP.

    torchrun --nproc_per_node=4 19_btcv_unetr.py --data_dir /dataset/BTCV \
        --json_list dataset_0.json --logdir unetr_btcv_run3
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from monai.data import CacheDataset, DataLoader, Dataset, decollate_batch, load_decathlon_datalist
from monai.data import DistributedSampler as MonaiSampler
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric
from monai.networks.nets import UNETR
from monai.transforms import (
    AsDiscrete,
    Compose,
    CropForegroundd,
    EnsureChannelFirstd,
    LoadImaged,
    Orientationd,
    RandCropByPosNegLabeld,
    RandFlipd,
    RandRotate90d,
    RandScaleIntensityd,
    RandShiftIntensityd,
    ScaleIntensityRanged,
    Spacingd,
    ToTensord,
)

parser = argparse.ArgumentParser(description="UNETR BTCV")
parser.add_argument("--data_dir", default="/dataset/BTCV")
parser.add_argument("--json_list", default="dataset_0.json")
parser.add_argument("--logdir", default="unetr_btcv")
parser.add_argument("--pretrained", default=None, help="pretrained ViT checkpoint")
parser.add_argument("--max_epochs", type=int, default=5000)
parser.add_argument("--batch_size", type=int, default=1)
parser.add_argument("--optim_lr", type=float, default=1e-4)
parser.add_argument("--reg_weight", type=float, default=1e-5)
parser.add_argument("--val_every", type=int, default=100)
parser.add_argument("--roi_x", type=int, default=96)
parser.add_argument("--roi_y", type=int, default=96)
parser.add_argument("--roi_z", type=int, default=96)
parser.add_argument("--infer_overlap", type=float, default=0.5)
parser.add_argument("--workers", type=int, default=8)


def save_checkpoint(model, epoch, filename, best_acc=0.0, optimizer=None, scheduler=None):
    state_dict = model.module.state_dict()
    save_dict = {"epoch": epoch, "best_acc": best_acc, "state_dict": state_dict}
    if optimizer is not None:
        save_dict["optimizer"] = optimizer.state_dict()
    if scheduler is not None:
        save_dict["scheduler"] = scheduler.state_dict()
    torch.save(save_dict, filename)
    print("Saving checkpoint", filename)


def get_loaders(args, rank, world_size):
    roi = (args.roi_x, args.roi_y, args.roi_z)
    train_tf = Compose([
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=(1.5, 1.5, 2.0), mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys=["image"], a_min=-175, a_max=250, b_min=0.0, b_max=1.0, clip=True),
        CropForegroundd(keys=["image", "label"], source_key="image"),
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=roi, pos=1, neg=1,
                               num_samples=4, image_key="image", image_threshold=0),
        RandFlipd(keys=["image", "label"], prob=0.2, spatial_axis=0),
        RandFlipd(keys=["image", "label"], prob=0.2, spatial_axis=1),
        RandFlipd(keys=["image", "label"], prob=0.2, spatial_axis=2),
        RandRotate90d(keys=["image", "label"], prob=0.2, max_k=3),
        RandScaleIntensityd(keys="image", factors=0.1, prob=0.1),
        RandShiftIntensityd(keys="image", offsets=0.1, prob=0.1),
        ToTensord(keys=["image", "label"]),
    ])
    val_tf = Compose([
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=(1.5, 1.5, 2.0), mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys=["image"], a_min=-175, a_max=250, b_min=0.0, b_max=1.0, clip=True),
        CropForegroundd(keys=["image", "label"], source_key="image"),
        ToTensord(keys=["image", "label"]),
    ])
    datalist_json = os.path.join(args.data_dir, args.json_list)
    train_files = load_decathlon_datalist(datalist_json, True, "training", base_dir=args.data_dir)
    val_files = load_decathlon_datalist(datalist_json, True, "validation", base_dir=args.data_dir)

    train_ds = CacheDataset(train_files, transform=train_tf, cache_num=24, cache_rate=1.0, num_workers=args.workers)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True)
    val_ds = Dataset(val_files, transform=val_tf)
    val_sampler = MonaiSampler(val_ds, shuffle=False, even_divisible=False)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=val_sampler, num_workers=args.workers)
    return train_loader, train_sampler, val_loader


def main():
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    args.logdir = os.path.join("./runs", args.logdir)
    torch.backends.cudnn.benchmark = True

    train_loader, train_sampler, val_loader = get_loaders(args, rank, world_size)
    roi = (args.roi_x, args.roi_y, args.roi_z)

    model = UNETR(in_channels=1, out_channels=14, img_size=roi, feature_size=16, hidden_size=768,
                  mlp_dim=3072, num_heads=12, proj_type="perceptron", norm_name="instance",
                  res_block=True, dropout_rate=0.0)
    if args.pretrained:
        vit = torch.load(args.pretrained, map_location="cpu")
        model.vit.load_state_dict(vit, strict=False)
    model.cuda(local_rank)
    model = DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)

    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, squared_pred=True, smooth_nr=0.0, smooth_dr=1e-6)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.optim_lr, weight_decay=args.reg_weight)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.max_epochs)
    dice_acc = DiceMetric(include_background=False, reduction="mean", get_not_nans=False)
    post_label = AsDiscrete(to_onehot=14)
    post_pred = AsDiscrete(argmax=True, to_onehot=14)

    writer = None
    if rank == 0:
        os.makedirs(args.logdir, exist_ok=True)
        writer = SummaryWriter(log_dir=args.logdir)
        print(f"Writing Tensorboard logs to {args.logdir}")

    val_acc_max = 0.0
    for epoch in range(args.max_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        epoch_time = time.time()
        run_loss = torch.zeros(2, device=device)
        for batch in train_loader:
            data, target = batch["image"].cuda(local_rank), batch["label"].cuda(local_rank)
            for param in model.parameters():
                param.grad = None
            logits = model(data)
            loss = loss_fn(logits, target)
            loss.backward()
            optimizer.step()
            run_loss += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(run_loss)
        if rank == 0:
            print(f"Epoch {epoch}/{args.max_epochs - 1} loss: {(run_loss[0] / run_loss[1]).item():.4f} "
                  f"time {time.time() - epoch_time:.2f}s", flush=True)
            writer.add_scalar("train_loss", (run_loss[0] / run_loss[1]).item(), epoch)

        if (epoch + 1) % args.val_every == 0:
            model.eval()
            with torch.no_grad():
                for batch in val_loader:
                    data, target = batch["image"].cuda(local_rank), batch["label"].cuda(local_rank)
                    logits = sliding_window_inference(data, roi, 4, model.module, overlap=args.infer_overlap)
                    dice_acc(y_pred=[post_pred(x) for x in decollate_batch(logits)],
                             y=[post_label(x) for x in decollate_batch(target)])
            val_avg_acc = dice_acc.aggregate().item()
            dice_acc.reset()
            if rank == 0:
                print(f"Final validation {epoch}/{args.max_epochs - 1} acc {val_avg_acc:.4f}", flush=True)
                writer.add_scalar("val_acc", val_avg_acc, epoch)
            if val_avg_acc > val_acc_max:
                val_acc_max = val_avg_acc
                save_checkpoint(model, epoch, os.path.join(args.logdir, "model.pt"), best_acc=val_acc_max,
                                optimizer=optimizer, scheduler=scheduler)
            save_checkpoint(model, epoch, os.path.join(args.logdir, "model_final.pt"), best_acc=val_acc_max)
            dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
