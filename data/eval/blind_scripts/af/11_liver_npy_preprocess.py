"""
Liver / tumour segmentation (MSD Task03) from resampled .npy volumes.

The raw NIfTI files are resampled to a common spacing, clipped and z-scored once and
stored as .npy next to a properties.json; training reads random patches with mmap.

    torchrun --nproc_per_node=8 11_liver_npy_preprocess.py --raw /data/Task03_Liver \
        --prep /shared/prep/Task03_Liver_1.0x0.77x0.77 --out runs/liver_resunet
"""
import argparse
import json
import os
import time

import nibabel as nib
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from scipy.ndimage import zoom
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.networks.nets import SegResNet

TARGET_SPACING = (1.0, 0.77, 0.77)  # z, y, x
CLIP = (-17.0, 201.0)
MEAN, STD = 99.4, 39.4


def preprocess_dataset(raw_dir, prep_dir):
    os.makedirs(prep_dir, exist_ok=True)
    with open(os.path.join(raw_dir, "dataset.json")) as f:
        meta = json.load(f)
    props = {}
    for item in meta["training"]:
        case = os.path.basename(item["image"]).replace(".nii.gz", "")
        out = os.path.join(prep_dir, case + ".npy")
        img_nii = nib.load(os.path.join(raw_dir, item["image"]))
        spacing = img_nii.header.get_zooms()[::-1]
        props[case] = {"spacing": [float(s) for s in spacing], "shape": list(img_nii.shape[::-1])}
        if os.path.exists(out):
            continue
        img = np.asarray(img_nii.dataobj, dtype=np.float32).transpose(2, 1, 0)
        seg = np.asarray(nib.load(os.path.join(raw_dir, item["label"])).dataobj, dtype=np.uint8).transpose(2, 1, 0)
        factors = [s / t for s, t in zip(spacing, TARGET_SPACING)]
        img = zoom(img, factors, order=3)
        seg = zoom(seg, factors, order=0)
        img = (np.clip(img, *CLIP) - MEAN) / STD
        np.save(out, np.stack([img, seg.astype(np.float32)]).astype(np.float32))
    with open(os.path.join(prep_dir, "properties.json"), "w") as f:
        json.dump(props, f)
    return sorted(props)


class PatchDataset(Dataset):
    def __init__(self, prep_dir, cases, patch, fg_prob=0.5, samples_per_case=4):
        self.prep_dir, self.cases, self.patch = prep_dir, cases, np.array(patch)
        self.fg_prob, self.spc = fg_prob, samples_per_case

    def __len__(self):
        return len(self.cases) * self.spc

    def __getitem__(self, i):
        arr = np.load(os.path.join(self.prep_dir, self.cases[i // self.spc] + ".npy"), mmap_mode="r")
        shape = np.array(arr.shape[1:])
        hi = np.maximum(shape - self.patch, 0)
        if np.random.rand() < self.fg_prob:
            zs = np.nonzero(arr[1].max(axis=(1, 2)))[0]
            z = np.random.choice(zs) if len(zs) else np.random.randint(shape[0])
            ys, xs = np.nonzero(arr[1, z])
            c = np.array([z, ys.mean(), xs.mean()]) if len(ys) else shape // 2
            lo = np.clip((c - self.patch // 2).astype(int), 0, hi)
        else:
            lo = np.array([np.random.randint(h + 1) for h in hi])
        sl = tuple(slice(a, a + p) for a, p in zip(lo, self.patch))
        crop = np.array(arr[(slice(None),) + sl])
        pad = [(0, 0)] + [(0, int(p - s)) for p, s in zip(self.patch, crop.shape[1:])]
        crop = np.pad(crop, pad)
        if np.random.rand() < 0.5:
            crop = crop[:, :, :, ::-1]
        x = torch.from_numpy(crop[:1].copy())
        y = torch.from_numpy(crop[1:].copy()).long()
        return x, y


def worker_init(wid):
    np.random.seed((torch.initial_seed() + wid) % 2 ** 32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw", required=True)
    ap.add_argument("--prep", required=True)
    ap.add_argument("--out", default="runs/liver_resunet")
    ap.add_argument("--patch", type=int, nargs=3, default=[96, 160, 160])
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--val_cases", type=int, default=21)
    ap.add_argument("--val_every", type=int, default=20)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    cases = preprocess_dataset(args.raw, args.prep)
    val_cases, train_cases = cases[:args.val_cases], cases[args.val_cases:]

    train_ds = PatchDataset(args.prep, train_cases, args.patch)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=6, pin_memory=True,
                        worker_init_fn=worker_init, drop_last=True)

    model = SegResNet(spatial_dims=3, in_channels=1, out_channels=3, init_filters=32,
                      blocks_down=(1, 2, 2, 4, 4), blocks_up=(1, 1, 1, 1), norm="instance").to(device)
    model = DDP(model, device_ids=[local_rank])
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, batch=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, tot = time.time(), torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.cuda.amp.autocast():
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.val_every:
            continue
        model.eval()
        inter = torch.zeros(2, device=device)
        denom = torch.zeros(2, device=device)
        with torch.no_grad():
            for case in val_cases[rank::world]:
                arr = np.load(os.path.join(args.prep, case + ".npy"))
                x = torch.from_numpy(arr[None, :1]).to(device)
                y = torch.from_numpy(arr[1]).to(device).long()
                with torch.cuda.amp.autocast():
                    pred = sliding_window_inference(x, args.patch, 4, model.module, overlap=0.5).argmax(1)[0]
                for k, c in enumerate((1, 2)):
                    p, t = pred >= c, y >= c  # liver includes tumour
                    inter[k] += (p & t).sum()
                    denom[k] += p.sum() + t.sum()
        dist.all_reduce(inter)
        dist.all_reduce(denom)
        dice = (2 * inter / denom.clamp(min=1)).tolist()
        if rank == 0:
            print(f"  global dice liver {dice[0]:.4f} tumour {dice[1]:.4f}", flush=True)
            state = {"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict()}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if dice[1] > best:
                best = dice[1]
                torch.save(state, os.path.join(args.out, "best_tumour.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
