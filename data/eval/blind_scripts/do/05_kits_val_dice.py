"""KiTS23 kidney / tumour segmentation - 3D residual UNet, DDP.

    torchrun --nnodes=1 --nproc_per_node=8 05_kits_val_dice.py --config configs/kits_unet.yaml
"""
import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from monai.data import DataLoader, Dataset, PersistentDataset, partition_dataset
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.networks.nets import UNet
from monai.transforms import (
    Compose,
    CropForegroundd,
    EnsureChannelFirstd,
    EnsureTyped,
    LoadImaged,
    Orientationd,
    RandCropByPosNegLabeld,
    RandFlipd,
    RandRotate90d,
    RandShiftIntensityd,
    ScaleIntensityRanged,
    Spacingd,
)

DEFAULTS = {
    "data_root": "/data/kits23/dataset",
    "cache_dir": "/data/kits23/cache_persistent",
    "out_dir": "./outputs/kits_unet",
    "val_fraction": 0.2,
    "spacing": [0.78, 0.78, 0.78],
    "roi": [128, 128, 128],
    "batch_size": 2,
    "num_samples": 2,
    "epochs": 500,
    "lr": 2e-4,
    "val_every": 20,
    "num_workers": 8,
}


def load_config(path):
    cfg = dict(DEFAULTS)
    if path:
        with open(path) as f:
            cfg.update(yaml.safe_load(f) or {})
    return cfg


def list_cases(root):
    cases = []
    for case_dir in sorted(Path(root).glob("case_*")):
        cases.append({"image": str(case_dir / "imaging.nii.gz"), "label": str(case_dir / "segmentation.nii.gz")})
    return cases


def transforms(cfg):
    pre = [
        LoadImaged(keys=["image", "label"]),
        EnsureChannelFirstd(keys=["image", "label"]),
        Orientationd(keys=["image", "label"], axcodes="RAS"),
        Spacingd(keys=["image", "label"], pixdim=cfg["spacing"], mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=-54, a_max=242, b_min=0.0, b_max=1.0, clip=True),
        CropForegroundd(keys=["image", "label"], source_key="image", allow_smaller=True),
        EnsureTyped(keys=["image", "label"], track_meta=False),
    ]
    rand = [
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=cfg["roi"],
                               pos=2, neg=1, num_samples=cfg["num_samples"]),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=[0, 1, 2]),
        RandRotate90d(keys=["image", "label"], prob=0.25, max_k=3),
        RandShiftIntensityd(keys="image", offsets=0.1, prob=0.5),
    ]
    return pre, rand


def dice_np(pred, gt):
    inter = np.logical_and(pred, gt).sum()
    denom = pred.sum() + gt.sum()
    if denom == 0:
        return 1.0
    return 2.0 * inter / denom


@torch.no_grad()
def validate(net, loader, cfg, device):
    net.eval()
    kidney_sum, tumour_sum, n = 0.0, 0.0, 0
    for batch in loader:
        img = batch["image"].to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = sliding_window_inference(img, cfg["roi"], 4, net, overlap=0.5, mode="gaussian")
        pred = logits.argmax(1).cpu().numpy()
        gt = batch["label"][:, 0].numpy()
        for p, g in zip(pred, gt):
            # KiTS regions: kidney = kidney+tumour+cyst, tumour = tumour
            kidney_sum += dice_np(p > 0, g > 0)
            tumour_sum += dice_np(p == 2, g == 2)
            n += 1
    stats = torch.tensor([kidney_sum, tumour_sum, float(n)], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    kidney, tumour, total = stats.tolist()
    return kidney / total, tumour / total


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    cli = parser.parse_args()
    cfg = load_config(cli.config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # generous timeout: rank 0 builds the resampled cache on the first run
    dist.init_process_group(backend="nccl", timeout=timedelta(hours=3))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    cases = list_cases(cfg["data_root"])
    n_val = int(len(cases) * cfg["val_fraction"])
    train_cases, val_cases = cases[n_val:], cases[:n_val]

    pre, rand = transforms(cfg)
    if rank == 0:
        os.makedirs(cfg["cache_dir"], exist_ok=True)
        os.makedirs(cfg["out_dir"], exist_ok=True)
        # fill the persistent cache once, other ranks then only read it
        warm = PersistentDataset(train_cases, transform=Compose(pre), cache_dir=cfg["cache_dir"])
        for i in range(len(warm)):
            warm[i]
    dist.barrier()

    train_ds = PersistentDataset(train_cases, transform=Compose(pre + rand), cache_dir=cfg["cache_dir"])
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=17)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler,
                              num_workers=cfg["num_workers"], pin_memory=True)
    my_val = partition_dataset(val_cases, num_partitions=world_size, shuffle=False, even_divisible=False)[rank]
    val_loader = DataLoader(Dataset(my_val, transform=Compose(pre)), batch_size=1, num_workers=2)

    net = UNet(spatial_dims=3, in_channels=1, out_channels=4, channels=(32, 64, 128, 256, 320),
               strides=(2, 2, 2, 2), num_res_units=2, norm=("instance", {"affine": True})).to(device)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, include_background=False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=1e-5)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=10)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg["epochs"] - 10)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[10])
    scaler = torch.cuda.amp.GradScaler()

    best = -1.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for batch in train_loader:
            x = batch["image"].to(device, non_blocking=True)
            y = batch["label"].to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            running[0] += loss.detach()
            running[1] += 1
        sched.step()
        dist.all_reduce(running)
        if rank == 0:
            print(f"epoch {epoch:03d} loss {running[0].item() / running[1].item():.4f} "
                  f"lr {sched.get_last_lr()[0]:.2e} time {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % cfg["val_every"] == 0:
            kidney, tumour = validate(net, val_loader, cfg, device)
            score = (kidney + tumour) / 2
            if rank == 0:
                print(f"  val kidney {kidney:.4f} tumour {tumour:.4f}", flush=True)
                ckpt = {"epoch": epoch, "state_dict": net.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "cfg": cfg}
                torch.save(ckpt, os.path.join(cfg["out_dir"], "last.pt"))
                if score > best:
                    best = score
                    torch.save(ckpt, os.path.join(cfg["out_dir"], "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
