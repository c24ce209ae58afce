"""Hepatic vessel + tumour segmentation (MSD Task08), 3D residual UNet, DDP.

    torchrun --nproc_per_node=4 10_hepatic_vessel_ddp.py --root /data/Task08_HepaticVessel --fold 2
"""
import argparse
import dataclasses
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from monai.data import DataLoader, Dataset, list_data_collate
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.networks.nets import UNet
from monai.transforms import (
    Compose,
    CropForegroundd,
    EnsureChannelFirstd,
    LoadImaged,
    NormalizeIntensityd,
    Orientationd,
    RandFlipd,
    RandScaleIntensityd,
    RandSpatialCropSamplesd,
    ScaleIntensityRanged,
    Spacingd,
    SpatialPadd,
)


@dataclasses.dataclass
class Config:
    root: str
    fold: int = 0
    out_dir: str = "runs/hepaticvessel"
    patch: tuple = (128, 128, 64)
    samples_per_volume: int = 4
    batch_size: int = 1
    epochs: int = 400
    lr: float = 1e-2
    momentum: float = 0.99
    weight_decay: float = 3e-5
    val_every: int = 10
    workers: int = 6
    seed: int = 42


def get_cfg():
    p = argparse.ArgumentParser()
    for f in dataclasses.fields(Config):
        if f.name == "patch":
            p.add_argument("--patch", type=int, nargs=3, default=list(f.default))
        elif f.default is dataclasses.MISSING:
            p.add_argument(f"--{f.name}", type=f.type, required=True)
        else:
            p.add_argument(f"--{f.name}", type=type(f.default), default=f.default)
    return Config(**vars(p.parse_args()))


def get_data(cfg):
    with open(os.path.join(cfg.root, "dataset.json")) as f:
        training = json.load(f)["training"]
    items = sorted(
        ({"image": os.path.join(cfg.root, d["image"]), "label": os.path.join(cfg.root, d["label"])}
         for d in training), key=lambda d: d["image"])
    val_items = items[cfg.fold::5]
    train_items = [d for i, d in enumerate(items) if i % 5 != cfg.fold]
    load = [
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=(0.8, 0.8, 1.5), mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=-3, a_max=243, b_min=-3, b_max=243, clip=True),
        NormalizeIntensityd(keys="image", subtrahend=104.4, divisor=52.1),
        CropForegroundd(keys=["image", "label"], source_key="image"),
    ]
    train_tf = Compose(load + [
        SpatialPadd(keys=["image", "label"], spatial_size=cfg.patch),
        RandSpatialCropSamplesd(keys=["image", "label"], roi_size=cfg.patch, num_samples=cfg.samples_per_volume,
                                random_size=False),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=1),
        RandScaleIntensityd(keys="image", factors=0.1, prob=0.3),
    ])
    return Dataset(train_items, train_tf), Dataset(val_items, Compose(load)), len(val_items)


def main():
    cfg = get_cfg()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed + rank)

    train_ds, val_ds, n_val = get_data(cfg)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed)
    loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers,
                        collate_fn=list_data_collate, pin_memory=True)
    val_idx = list(range(rank, n_val, world))
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=1, num_workers=2)

    net = UNet(spatial_dims=3, in_channels=1, out_channels=3, channels=(32, 64, 128, 256, 320),
               strides=(2, 2, 2, 2), num_res_units=2, norm="instance").to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, nesterov=True,
                          weight_decay=cfg.weight_decay)
    total_steps = cfg.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (1 - s / total_steps) ** 0.9)
    criterion = DiceCELoss(to_onehot_y=True, softmax=True, batch=True)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)

    best = 0.0
    for epoch in range(cfg.epochs):
        model.train()
        sampler.set_epoch(epoch)
        tic = time.time()
        stats = torch.zeros(2, device=device)
        for batch in loader:
            x = batch["image"].to(device, non_blocking=True)
            y = batch["label"].to(device, non_blocking=True)
            if y.max() == 0:
                # patches without any vessel or tumour do not carry much signal, skip them
                continue
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 12.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            stats += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch}: loss {(stats[0] / stats[1].clamp(min=1)).item():.4f} "
                  f"steps {int(stats[1])} lr {opt.param_groups[0]['lr']:.5f} {time.time() - tic:.0f}s", flush=True)

        if (epoch + 1) % cfg.val_every == 0:
            net.eval()
            dice_sum = torch.zeros(2, device=device)
            count = torch.zeros(2, device=device)
            with torch.no_grad():
                for vb in val_loader:
                    img, lbl = vb["image"].to(device), vb["label"].to(device)
                    with torch.autocast("cuda", dtype=torch.float16):
                        pred = sliding_window_inference(img, cfg.patch, 4, net, overlap=0.5,
                                                        mode="gaussian").argmax(1)
                    for ci, c in enumerate((1, 2)):
                        p, g = pred == c, lbl[:, 0] == c
                        if g.any():
                            dice_sum[ci] += 2 * (p & g).sum() / (p.sum() + g.sum())
                            count[ci] += 1
            net.train()
            dist.all_reduce(dice_sum)
            dist.all_reduce(count)
            vessel, tumour = (dice_sum / count.clamp(min=1)).tolist()
            mean = (vessel + tumour) / 2
            if rank == 0:
                print(f"  val vessel {vessel:.4f} tumour {tumour:.4f} mean {mean:.4f}", flush=True)
                if mean > best:
                    best = mean
                    torch.save(net.state_dict(), os.path.join(cfg.out_dir, f"best_fold{cfg.fold}.pt"))
        if rank == 0 and (epoch + 1) % 25 == 0:
            torch.save({"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "scaler": scaler.state_dict()},
                       os.path.join(cfg.out_dir, "latest.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
