"""MedNeXt-style ConvNeXt U-Net for AbdomenCT-1K (liver, kidney, spleen, pancreas).

Large kernels + big patches do not fit into memory without activation checkpointing,
so every encoder / decoder stage is checkpointed.

    torchrun --nproc_per_node=4 17_mednext_abdomen1k.py --data /data/AbdomenCT-1K --fold 0
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from monai.data import DataLoader, Dataset
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.transforms import (
    Compose,
    CropForegroundd,
    EnsureChannelFirstd,
    LoadImaged,
    NormalizeIntensityd,
    Orientationd,
    RandCropByPosNegLabeld,
    RandFlipd,
    ScaleIntensityRanged,
    Spacingd,
    SpatialPadd,
)

PATCH = (128, 128, 128)


class MedNeXtBlock(nn.Module):
    def __init__(self, ch, exp=4, k=5):
        super().__init__()
        self.dw = nn.Conv3d(ch, ch, k, padding=k // 2, groups=ch)
        self.norm = nn.GroupNorm(ch, ch)
        self.pw1 = nn.Conv3d(ch, exp * ch, 1)
        self.pw2 = nn.Conv3d(exp * ch, ch, 1)

    def forward(self, x):
        return x + self.pw2(F.gelu(self.pw1(self.norm(self.dw(x)))))


class Down(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv3d(cin, cout, 2, stride=2)
        self.norm = nn.GroupNorm(cout, cout)

    def forward(self, x):
        return self.norm(self.conv(x))


class MedNeXt(nn.Module):
    def __init__(self, in_ch=1, n_cls=5, c=32, blocks=(2, 2, 2, 2, 2), grad_checkpoint=True):
        super().__init__()
        self.grad_checkpoint = grad_checkpoint
        chs = [c * 2 ** i for i in range(len(blocks))]
        self.stem = nn.Conv3d(in_ch, c, 1)
        self.enc = nn.ModuleList([nn.Sequential(*[MedNeXtBlock(chs[i]) for _ in range(n)]) for i, n in enumerate(blocks)])
        self.down = nn.ModuleList([Down(chs[i], chs[i + 1]) for i in range(len(chs) - 1)])
        self.up = nn.ModuleList([nn.ConvTranspose3d(chs[i + 1], chs[i], 2, 2) for i in reversed(range(len(chs) - 1))])
        self.dec = nn.ModuleList([nn.Sequential(*[MedNeXtBlock(chs[i]) for _ in range(blocks[i])])
                                  for i in reversed(range(len(chs) - 1))])
        self.heads = nn.ModuleList([nn.Conv3d(chs[i], n_cls, 1) for i in reversed(range(len(chs) - 1))])
        # gives checkpoint() an input that requires grad, so the stage still gets gradients
        self.dummy = torch.ones(1, requires_grad=True)

    def _stage(self, mod, x):
        if self.grad_checkpoint and self.training:
            return cp.checkpoint(lambda t, _d: mod(t), x, self.dummy)
        return mod(x)

    def forward(self, x):
        x = self.stem(x)
        skips = []
        for i, blk in enumerate(self.enc):
            x = self._stage(blk, x)
            if i < len(self.down):
                skips.append(x)
                x = self.down[i](x)
        outs = []
        for up, blk, head in zip(self.up, self.dec, self.heads):
            x = self._stage(blk, up(x) + skips.pop())
            outs.append(head(x))
        outs = outs[::-1]  # highest resolution first
        return outs if self.training else outs[0]


def get_lists(root, fold):
    with open(os.path.join(root, "cv_5fold.json")) as f:
        folds = json.load(f)
    mk = lambda c: {"image": os.path.join(root, "Image", f"{c}_0000.nii.gz"),
                    "label": os.path.join(root, "Mask", f"{c}.nii.gz")}
    val = [mk(c) for c in folds[fold]]
    train = [mk(c) for k, cases in enumerate(folds) if k != fold for c in cases]
    return train, val


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--val_every", type=int, default=25)
    ap.add_argument("--out", default="runs/mednext_ab1k")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    pre = [LoadImaged(keys=["image", "label"]), EnsureChannelFirstd(keys=["image", "label"]),
           Orientationd(keys=["image", "label"], axcodes="RAS"),
           Spacingd(keys=["image", "label"], pixdim=(1.0, 1.0, 2.5), mode=("bilinear", "nearest")),
           ScaleIntensityRanged(keys="image", a_min=-160, a_max=240, b_min=-160, b_max=240, clip=True),
           NormalizeIntensityd(keys="image", subtrahend=80.0, divisor=60.0),
           CropForegroundd(keys=["image", "label"], source_key="image")]
    train_tf = Compose(pre + [
        SpatialPadd(keys=["image", "label"], spatial_size=PATCH),
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=PATCH, pos=1, neg=1,
                               num_samples=1),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=1),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=2),
    ])
    train_files, val_files = get_lists(args.data, args.fold)
    train_ds = Dataset(train_files, train_tf)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True)
    val_loader = DataLoader(Dataset(val_files[rank::world], Compose(pre)), batch_size=1, num_workers=2)

    net = MedNeXt().to(device)
    net.dummy = net.dummy.to(device)
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: (1 - e / args.epochs) ** 0.9)
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, batch=True)
    ds_w = [1.0, 0.5, 0.25, 0.125]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = -1.0
    for epoch in range(args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        t0, acc = time.time(), torch.zeros(2, device=device)
        for batch in loader:
            x, y = batch["image"].to(device), batch["label"].to(device)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                outs = model(x)
            loss = 0.0
            for w, o in zip(ds_w, outs):
                t = y if o.shape[2:] == y.shape[2:] else F.interpolate(y, size=o.shape[2:], mode="nearest")
                loss = loss + w * loss_fn(o.float(), t)
            loss = loss / sum(ds_w)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(acc)
        if rank == 0:
            print(f"ep {epoch} loss {(acc[0] / acc[1]).item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.val_every == 0:
            net.eval()
            sums = torch.zeros(2, 4, device=device)  # dice sum / count per organ
            with torch.no_grad():
                for vb in val_loader:
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        pred = sliding_window_inference(vb["image"].to(device), PATCH, 2, net, overlap=0.5,
                                                        mode="gaussian").argmax(1)[0]
                    gt = vb["label"][0, 0].to(device)
                    for c in range(1, 5):
                        p, g = pred == c, gt == c
                        if g.any():
                            sums[0, c - 1] += 2 * (p & g).sum() / (p.sum() + g.sum())
                            sums[1, c - 1] += 1
            net.train()
            dist.all_reduce(sums)
            organ = (sums[0] / sums[1].clamp(min=1)).tolist()
            mean = float(np.mean(organ))
            if rank == 0:
                print("  val liver {:.4f} kidney {:.4f} spleen {:.4f} pancreas {:.4f} mean {:.4f}".format(*organ, mean),
                      flush=True)
                if mean > best:
                    best = mean
                    torch.save(net.state_dict(), os.path.join(args.out, f"fold{args.fold}_best.pt"))
        if rank == 0:
            torch.save({"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, os.path.join(args.out, f"fold{args.fold}_last.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
