"""UNETR on BTCV (13 abdominal organs), distributed data parallel.

    torchrun --nproc_per_node=4 12_btcv_unetr.py --json /data/btcv/dataset_0.json --data_dir /data/btcv
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from monai.data import DataLoader, Dataset, DistributedSampler, load_decathlon_datalist
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.networks.nets import UNETR
from monai.transforms import (
    Compose,
    CropForegroundd,
    EnsureChannelFirstd,
    LoadImaged,
    Orientationd,
    RandCropByPosNegLabeld,
    RandFlipd,
    RandRotate90d,
    RandShiftIntensityd,
    ScaleIntensityRanged,
    Spacingd,
    ToTensord,
)

ORGANS = ["spleen", "rkid", "lkid", "gall", "eso", "liver", "sto", "aorta", "IVC", "veins", "pancreas", "rad", "lad"]


def get_args():
    parser = argparse.ArgumentParser("UNETR BTCV")
    parser.add_argument("--json", required=True)
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--fold", type=int, default=0, help="fold of the 5-fold CV over the training list")
    parser.add_argument("--max_epochs", type=int, default=5000)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--optim_lr", type=float, default=1e-4)
    parser.add_argument("--reg_weight", type=float, default=1e-5)
    parser.add_argument("--val_every", type=int, default=100)
    parser.add_argument("--roi", type=int, nargs=3, default=[96, 96, 96])
    parser.add_argument("--logdir", default="runs/unetr_btcv")
    parser.add_argument("--workers", type=int, default=8)
    return parser.parse_args()


def get_loaders(args, rank, world):
    tr = Compose([
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=(1.5, 1.5, 2.0), mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys=["image"], a_min=-175, a_max=250, b_min=0.0, b_max=1.0, clip=True),
        CropForegroundd(keys=["image", "label"], source_key="image"),
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=args.roi,
                               pos=1, neg=1, num_samples=4, image_key="image", image_threshold=0),
        RandFlipd(keys=["image", "label"], prob=0.1, spatial_axis=0),
        RandFlipd(keys=["image", "label"], prob=0.1, spatial_axis=1),
        RandFlipd(keys=["image", "label"], prob=0.1, spatial_axis=2),
        RandRotate90d(keys=["image", "label"], prob=0.1, max_k=3),
        RandShiftIntensityd(keys="image", offsets=0.1, prob=0.5),
        ToTensord(keys=["image", "label"]),
    ])
    va = Compose([
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=(1.5, 1.5, 2.0), mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys=["image"], a_min=-175, a_max=250, b_min=0.0, b_max=1.0, clip=True),
        CropForegroundd(keys=["image", "label"], source_key="image"),
        ToTensord(keys=["image", "label"]),
    ])
    files = sorted(load_decathlon_datalist(args.json, True, "training", base_dir=args.data_dir),
                   key=lambda d: d["image"])
    val_files = [f for i, f in enumerate(files) if i % 5 == args.fold]
    train_files = [f for i, f in enumerate(files) if i % 5 != args.fold]

    train_ds = Dataset(train_files, tr)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True)
    val_ds = Dataset(val_files, va)
    val_sampler = DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False, even_divisible=False)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=val_sampler, num_workers=2)
    return train_loader, train_sampler, val_loader


def organ_dice(pred, gt):
    """pred/gt: numpy label maps. Returns (sum of dice per organ, count per organ)."""
    s, n = np.zeros(len(ORGANS)), np.zeros(len(ORGANS))
    for i in range(1, len(ORGANS) + 1):
        g = gt == i
        if not g.any():
            continue
        p = pred == i
        s[i - 1] = 2.0 * np.logical_and(p, g).sum() / (p.sum() + g.sum())
        n[i - 1] = 1
    return s, n


def main():
    args = get_args()
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s | %(message)s")
    log = logging.getLogger("unetr")

    train_loader, train_sampler, val_loader = get_loaders(args, rank, world)

    net = UNETR(in_channels=1, out_channels=14, img_size=tuple(args.roi), feature_size=16, hidden_size=768,
                mlp_dim=3072, num_heads=12, proj_type="perceptron", norm_name="instance", res_block=True,
                dropout_rate=0.0).to(device)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, squared_pred=True, smooth_nr=0.0, smooth_dr=1e-6)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.optim_lr, weight_decay=args.reg_weight)
    scheduler = torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=args.max_epochs, power=0.9)
    scaler = torch.cuda.amp.GradScaler()
    if rank == 0:
        os.makedirs(args.logdir, exist_ok=True)

    best_dice = 0.0
    for epoch in range(args.max_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run_loss = torch.zeros(2, device=device)
        for batch in train_loader:
            data, target = batch["image"].to(device), batch["label"].to(device)
            for p in model.parameters():
                p.grad = None
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(data)
                loss = loss_fn(logits, target)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            run_loss += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(run_loss)
        log.info(f"Epoch {epoch}/{args.max_epochs} loss: {(run_loss[0] / run_loss[1]).item():.4f} "
                 f"time {time.time() - t0:.2f}s")

        if (epoch + 1) % args.val_every == 0:
            net.eval()
            dice_sum, dice_cnt = np.zeros(len(ORGANS)), np.zeros(len(ORGANS))
            with torch.no_grad():
                for batch in val_loader:
                    data = batch["image"].to(device)
                    with torch.autocast("cuda", dtype=torch.float16):
                        logits = sliding_window_inference(data, args.roi, 4, net, overlap=0.5)
                    pred = logits.argmax(1)[0].cpu().numpy()
                    s, n = organ_dice(pred, batch["label"][0, 0].numpy())
                    dice_sum += s
                    dice_cnt += n
            net.train()
            stats = torch.from_numpy(np.concatenate([dice_sum, dice_cnt]))
            dist.all_reduce(stats, op=dist.ReduceOp.SUM)
            per_organ = (stats[:len(ORGANS)] / stats[len(ORGANS):].clamp(min=1)).numpy()
            mean_dice = float(per_organ.mean())
            if rank == 0:
                log.info("val " + " ".join(f"{o}={d:.3f}" for o, d in zip(ORGANS, per_organ))
                         + f" | mean {mean_dice:.4f}")
                if mean_dice > best_dice:
                    best_dice = mean_dice
                    torch.save({"epoch": epoch, "best_acc": best_dice, "state_dict": net.state_dict()},
                               os.path.join(args.logdir, "model.pt"))
                    log.info(f"new best {best_dice:.4f}")
                torch.save({"epoch": epoch, "best_acc": best_dice, "state_dict": net.state_dict(),
                            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                           os.path.join(args.logdir, "model_final.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
