"""Swin-UNETR for MSD Task06_Lung (tumour), DDP.

Raw NIfTI is resampled once to the target spacing and cached as .npy so the
data loader can memory-map it.

    torchrun --nproc_per_node=8 08_lung_swinunetr_npycache.py \
        --raw /data/msd/Task06_Lung --cache /scratch/lung_npy --fold 0
"""
import argparse
import json
import os
import random
import time

import numpy as np
import SimpleITK as sitk
import torch
import torch.distributed as dist
import torch.nn.functional as F
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.networks.nets import SwinUNETR
from sklearn.model_selection import KFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TARGET_SPACING = (0.8, 0.8, 1.25)  # x, y, z as in SimpleITK
ROI = (96, 96, 96)


def resample(img, spacing, interp):
    size = [int(round(sz * sp / t)) for sz, sp, t in zip(img.GetSize(), img.GetSpacing(), spacing)]
    return sitk.Resample(img, size, sitk.Transform(), interp, img.GetOrigin(), spacing,
                         img.GetDirection(), 0, img.GetPixelID())


def preprocess_dataset(raw_dir, cache_dir, cases):
    os.makedirs(cache_dir, exist_ok=True)
    for case in cases:
        img_out = os.path.join(cache_dir, f"{case}_img.npy")
        seg_out = os.path.join(cache_dir, f"{case}_seg.npy")
        if os.path.exists(img_out) and os.path.exists(seg_out):
            continue
        img = sitk.ReadImage(os.path.join(raw_dir, "imagesTr", f"{case}.nii.gz"))
        seg = sitk.ReadImage(os.path.join(raw_dir, "labelsTr", f"{case}.nii.gz"))
        img = sitk.GetArrayFromImage(resample(img, TARGET_SPACING, sitk.sitkBSpline)).astype(np.float32)
        seg = sitk.GetArrayFromImage(resample(seg, TARGET_SPACING, sitk.sitkNearestNeighbor)).astype(np.uint8)
        img = np.clip(img, -1000, 300)
        img = (img - (-480.0)) / 460.0
        np.save(img_out, img)
        np.save(seg_out, seg)
        np.save(os.path.join(cache_dir, f"{case}_fg.npy"), np.argwhere(seg > 0).astype(np.int32))


class LungPatches(Dataset):
    def __init__(self, cache_dir, cases, roi, fg_ratio=0.5, repeats=8):
        self.cache, self.roi, self.fg_ratio = cache_dir, np.array(roi), fg_ratio
        self.items = [c for c in cases for _ in range(repeats)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        case = self.items[idx]
        img = np.load(os.path.join(self.cache, f"{case}_img.npy"), mmap_mode="r")
        seg = np.load(os.path.join(self.cache, f"{case}_seg.npy"), mmap_mode="r")
        fg = np.load(os.path.join(self.cache, f"{case}_fg.npy"), mmap_mode="r")
        shape = np.array(img.shape)
        hi = np.maximum(shape - self.roi, 0)
        if len(fg) and random.random() < self.fg_ratio:
            c = np.array(fg[random.randrange(len(fg))])
            start = np.clip(c - self.roi // 2 + np.random.randint(-16, 17, 3), 0, hi)
        else:
            start = np.array([random.randint(0, h) for h in hi])
        sl = tuple(slice(s, s + r) for s, r in zip(start, self.roi))
        x = torch.from_numpy(np.ascontiguousarray(img[sl]))[None]
        y = torch.from_numpy(np.ascontiguousarray(seg[sl]).astype(np.int64))[None]
        pad = [v for d in reversed(range(3)) for v in (0, int(self.roi[d] - x.shape[d + 1]))]
        x, y = F.pad(x, pad), F.pad(y, pad)
        for ax in (1, 2, 3):
            if random.random() < 0.5:
                x, y = x.flip(ax), y.flip(ax)
        return x, y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--eval_every", type=int, default=10)
    ap.add_argument("--pretrained", default=None, help="self-supervised Swin encoder weights")
    ap.add_argument("--save_dir", default="ckpt/lung")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(os.path.join(args.raw, "dataset.json")) as f:
        cases = sorted(os.path.basename(d["image"]).replace(".nii.gz", "") for d in json.load(f)["training"])
    preprocess_dataset(args.raw, args.cache, cases)

    folds = list(KFold(5, shuffle=True, random_state=2023).split(cases))
    train_cases = [cases[i] for i in folds[args.fold][0]]
    val_cases = [cases[i] for i in folds[args.fold][1]]

    random.seed(1234 + rank)
    np.random.seed(1234 + rank)
    train_ds = LungPatches(args.cache, train_cases, ROI)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, num_workers=8,
                        pin_memory=True, persistent_workers=True,
                        worker_init_fn=lambda w: np.random.seed((torch.initial_seed() + w) % 2 ** 32))

    net = SwinUNETR(img_size=ROI, in_channels=1, out_channels=2, feature_size=48, use_checkpoint=False)
    if args.pretrained:
        weights = torch.load(args.pretrained, map_location="cpu")
        net.load_from(weights=weights)
    net.to(device)
    model = DDP(net, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=args.epochs, power=0.9)
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, batch=True)
    scaler = torch.cuda.amp.GradScaler()
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    best = -1.0
    for epoch in range(args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        t0, agg = time.time(), torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            agg += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(agg)
        if rank == 0:
            print(f"epoch {epoch} loss {(agg[0] / agg[1]).item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                  f"time {time.time() - t0:.1f}s", flush=True)

        if (epoch + 1) % args.eval_every == 0:
            net.eval()
            sums = torch.zeros(2, device=device)  # dice sum, n cases with tumour
            with torch.no_grad():
                for case in val_cases[rank::world]:
                    img = np.load(os.path.join(args.cache, f"{case}_img.npy"))
                    seg = torch.from_numpy(np.load(os.path.join(args.cache, f"{case}_seg.npy"))).to(device)
                    x = torch.from_numpy(img)[None, None].to(device)
                    with torch.autocast("cuda", dtype=torch.float16):
                        pred = sliding_window_inference(x, ROI, 4, net, overlap=0.5, mode="gaussian").argmax(1)[0]
                    p, g = pred == 1, seg == 1
                    if g.any():
                        sums[0] += 2 * (p & g).sum() / (p.sum() + g.sum())
                        sums[1] += 1
            net.train()
            dist.all_reduce(sums)
            mean_dice = (sums[0] / sums[1].clamp(min=1)).item()
            if rank == 0:
                print(f"epoch {epoch} val tumour dice {mean_dice:.4f} ({int(sums[1])} cases)", flush=True)
                if mean_dice > best:
                    best = mean_dice
                    torch.save(net.state_dict(), os.path.join(args.save_dir, f"swinunetr_f{args.fold}_best.pt"))
        if rank == 0:
            torch.save({"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "best": best},
                       os.path.join(args.save_dir, f"swinunetr_f{args.fold}_last.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
