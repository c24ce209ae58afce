"""Lung tumour segmentation (MSD Task06_Lung, NSCLC) - 3D residual UNet.

Small targets, so patches are sampled 3:1 around tumour voxels.

    torchrun --standalone --nproc_per_node=4 18_msd_lung_tumour.py --cfg cfg/lung_unet.json
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from monai.data import CacheDataset, DataLoader, Dataset, decollate_batch, load_decathlon_datalist
from monai.data import DistributedSampler as MonaiDistSampler
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric
from monai.networks.nets import UNet
from monai.transforms import (
    AsDiscrete,
    Compose,
    CropForegroundd,
    EnsureChannelFirstd,
    EnsureTyped,
    LoadImaged,
    Orientationd,
    RandCropByPosNegLabeld,
    RandFlipd,
    RandGaussianSmoothd,
    RandScaleIntensityd,
    ScaleIntensityRanged,
    Spacingd,
)

CFG = {
    "data_dir": "/datasets/MSD/Task06_Lung",
    "out_dir": "/experiments/lung_tumour/unet_res",
    "spacing": [0.79, 0.79, 1.24],
    "patch": [160, 160, 80],
    "batch_size": 2,
    "samples": 2,
    "epochs": 600,
    "lr": 1e-3,
    "weight_decay": 3e-5,
    "n_val": 13,
    "val_every": 20,
}


def load_cfg(path):
    cfg = dict(CFG)
    if path:
        with open(path) as f:
            cfg.update(json.load(f))
    return cfg


def get_transforms(cfg):
    pre = [
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=cfg["spacing"], mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=-1024, a_max=325, b_min=0.0, b_max=1.0, clip=True),
        CropForegroundd(keys=["image", "label"], source_key="image", select_fn=lambda x: x > 0.05),
        EnsureTyped(keys=["image", "label"]),
    ]
    train = Compose(pre + [
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=cfg["patch"],
                               pos=3, neg=1, num_samples=cfg["samples"]),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=1),
        RandGaussianSmoothd(keys="image", prob=0.1),
        RandScaleIntensityd(keys="image", factors=0.1, prob=0.3),
    ])
    return train, Compose(pre)


def train_one_epoch(model, loader, loss_fn, optimizer, scaler, device):
    model.train()
    total = torch.zeros(2, device=device)
    for batch in loader:
        x = batch["image"].to(device, non_blocking=True)
        y = batch["label"].to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.cuda.amp.autocast():
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 12.0)
        scaler.step(optimizer)
        scaler.update()
        total += torch.stack([loss.detach().float(), torch.ones((), device=device)])
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


@torch.no_grad()
def evaluate(net, loader, metric, cfg, device):
    net.eval()
    post_pred, post_label = AsDiscrete(argmax=True, to_onehot=2), AsDiscrete(to_onehot=2)
    for batch in loader:
        x, y = batch["image"].to(device), batch["label"].to(device)
        with torch.cuda.amp.autocast():
            out = sliding_window_inference(x, cfg["patch"], 4, net, overlap=0.5, mode="gaussian")
        metric(y_pred=[post_pred(o) for o in decollate_batch(out)], y=[post_label(t) for t in decollate_batch(y)])
    score = metric.aggregate().item()
    metric.reset()
    return score


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    cfg = load_cfg(ap.parse_args().cfg)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    items = load_decathlon_datalist(os.path.join(cfg["data_dir"], "dataset.json"), True, "training",
                                    base_dir=cfg["data_dir"])
    val_items, train_items = items[: cfg["n_val"]], items[cfg["n_val"]:]
    train_tf, val_tf = get_transforms(cfg)

    train_ds = CacheDataset(train_items, train_tf, cache_rate=1.0, num_workers=8)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler, num_workers=6,
                              pin_memory=True)
    val_ds = Dataset(val_items, val_tf)
    val_loader = DataLoader(val_ds, batch_size=1, num_workers=2,
                            sampler=MonaiDistSampler(val_ds, shuffle=False, even_divisible=False))

    net = UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(32, 64, 128, 256, 320),
               strides=((2, 2, 1), 2, 2, 2), num_res_units=2, norm="instance").to(device)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, include_background=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.99, nesterov=True,
                                weight_decay=cfg["weight_decay"])
    scheduler = torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=cfg["epochs"], power=0.9)
    scaler = torch.cuda.amp.GradScaler()
    metric = DiceMetric(include_background=False, reduction="mean")

    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        with open(os.path.join(cfg["out_dir"], "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
    best = 0.0

    for epoch in range(cfg["epochs"]):
        t0 = time.time()
        loss = train_one_epoch(model, train_loader, loss_fn, optimizer, scaler, device)
        scheduler.step()
        if rank == 0:
            print(f"epoch {epoch + 1:4d}  loss {loss:.4f}  lr {scheduler.get_last_lr()[0]:.2e}  "
                  f"{time.time() - t0:.0f}s", flush=True)
        if (epoch + 1) % cfg["val_every"] == 0:
            dice = evaluate(net, val_loader, metric, cfg, device)
            if rank == 0:
                print(f"    tumour dice {dice:.4f}", flush=True)
                state = {"epoch": epoch + 1, "model": net.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "dice": dice}
                torch.save(state, os.path.join(cfg["out_dir"], "last.pt"))
                if dice > best:
                    best = dice
                    torch.save(state, os.path.join(cfg["out_dir"], "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
