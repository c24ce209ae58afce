"""ISLES'22 ischemic stroke lesion segmentation (DWI + ADC), 5-fold cross-validation.

    torchrun --nproc_per_node=4 13_isles_stroke_cv.py --data /data/isles22_nii --fold 0
"""
import argparse
import glob
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from monai.data import DataLoader, Dataset
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.networks.nets import DynUNet
from monai.transforms import (
    Compose,
    ConcatItemsd,
    DeleteItemsd,
    EnsureChannelFirstd,
    LoadImaged,
    NormalizeIntensityd,
    RandAffined,
    RandCropByPosNegLabeld,
    RandFlipd,
    RandGaussianNoised,
    Spacingd,
    SpatialPadd,
)

PATCH = (128, 128, 64)


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def list_cases(root):
    cases = []
    for dwi in sorted(glob.glob(os.path.join(root, "sub-strokecase*", "*_dwi.nii.gz"))):
        base = dwi[: -len("_dwi.nii.gz")]
        cases.append({"dwi": dwi, "adc": base + "_adc.nii.gz", "label": base + "_msk.nii.gz"})
    return cases


def make_folds(cases, n_folds=5):
    order = np.random.permutation(len(cases))
    return [[cases[i] for i in order[k::n_folds]] for k in range(n_folds)]


def transforms():
    base = [
        LoadImaged(keys=["dwi", "adc", "label"]),
        EnsureChannelFirstd(keys=["dwi", "adc", "label"]),
        Spacingd(keys=["dwi", "adc", "label"], pixdim=(1.0, 1.0, 2.0), mode=("bilinear", "bilinear", "nearest")),
        ConcatItemsd(keys=["dwi", "adc"], name="image"),
        DeleteItemsd(keys=["dwi", "adc"]),
        NormalizeIntensityd(keys="image", nonzero=True, channel_wise=True),
    ]
    train = Compose(base + [
        SpatialPadd(keys=["image", "label"], spatial_size=PATCH),
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=PATCH, pos=2, neg=1,
                               num_samples=2),
        RandAffined(keys=["image", "label"], prob=0.2, rotate_range=(0.26, 0.26, 0.26), scale_range=0.1,
                    mode=("bilinear", "nearest")),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
        RandGaussianNoised(keys="image", prob=0.15, std=0.05),
    ])
    return train, Compose(base)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=2022)
    ap.add_argument("--val_every", type=int, default=5)
    ap.add_argument("--out", default="runs/isles")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    # different augmentation streams on every GPU
    seed_everything(args.seed + rank)

    folds = make_folds(list_cases(args.data))
    val_cases = folds[args.fold]
    train_cases = [c for k, f in enumerate(folds) if k != args.fold for c in f]
    train_tf, val_tf = transforms()

    train_ds = Dataset(train_cases, train_tf)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6, pin_memory=True)
    val_loader = DataLoader(Dataset(val_cases[rank::world], val_tf), batch_size=1, num_workers=2)

    net = DynUNet(3, 2, 2, kernel_size=[3, 3, 3, 3, 3], strides=[1, 2, 2, 2, [2, 2, 1]],
                  upsample_kernel_size=[2, 2, 2, [2, 2, 1]], filters=[32, 64, 128, 256, 320],
                  norm_name="instance", deep_supervision=True, deep_supr_num=2).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.99, nesterov=True, weight_decay=3e-5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: (1 - e / args.epochs) ** 0.9)
    scaler = torch.cuda.amp.GradScaler()
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, batch=True)
    ds_w = torch.tensor([1.0, 0.5, 0.25])
    ds_w = (ds_w / ds_w.sum()).tolist()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"fold {args.fold}: {len(train_cases)} train / {len(val_cases)} val cases", flush=True)

    best = -1.0
    for epoch in range(args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for batch in loader:
            x, y = batch["image"].to(device), batch["label"].to(device)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(x)
                loss = sum(w * loss_fn(out[:, i], y) for i, w in enumerate(ds_w))
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 12)
            scaler.step(opt)
            scaler.update()
            acc += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(acc)
        if rank == 0:
            print(f"[{epoch:03d}] loss {(acc[0] / acc[1]).item():.4f} lr {sched.get_last_lr()[0]:.5f} "
                  f"{time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.val_every:
            continue
        net.eval()
        res = torch.zeros(2, device=device)  # sum of per-case dice, number of cases
        with torch.no_grad():
            for vb in val_loader:
                x = vb["image"].to(device)
                with torch.autocast("cuda", dtype=torch.float16):
                    prob = sliding_window_inference(x, PATCH, 4, net, overlap=0.5, mode="gaussian").softmax(1)
                    # mirror along the left-right axis
                    prob += sliding_window_inference(x.flip(2), PATCH, 4, net, overlap=0.5,
                                                     mode="gaussian").softmax(1).flip(2)
                p = prob.argmax(1)[0] == 1
                g = vb["label"][0, 0].to(device) == 1
                denom = p.sum() + g.sum()
                res += torch.stack([(2 * (p & g).sum() / denom) if denom > 0 else torch.ones((), device=device),
                                    torch.ones((), device=device)])
        net.train()
        dist.all_reduce(res)
        dice = (res[0] / res[1]).item()
        if rank == 0:
            print(f"[{epoch:03d}] val dice {dice:.4f} ({int(res[1].item())} cases)", flush=True)
            state = {"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict(),
                     "sched": sched.state_dict(), "dice": dice}
            torch.save(state, os.path.join(args.out, f"fold{args.fold}_last.pt"))
            if dice > best:
                best = dice
                torch.save(state, os.path.join(args.out, f"fold{args.fold}_best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
