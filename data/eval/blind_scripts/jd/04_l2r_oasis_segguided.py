"""
Learn2Reg 2021 Task 3 (OASIS) - segmentation-guided deformable registration with MONAI.

Loss = LNCC(fixed, warped) + w_dice * Dice(fixed_seg, warped_seg) + w_be * BendingEnergy(ddf)

    torchrun --nproc_per_node=4 04_l2r_oasis_segguided.py --root /data/L2R_2021_Task3 --amp
"""
import argparse
import json
import os
import time
from dataclasses import dataclass

import nibabel as nib
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from monai.losses import BendingEnergyLoss, DiceLoss, LocalNormalizedCrossCorrelationLoss
from monai.metrics import DiceMetric
from monai.networks.blocks import DVF2DDF, Warp
from monai.networks.nets import UNet
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class Config:
    root: str
    out: str = "work_dirs/l2r_oasis"
    epochs: int = 200
    batch_size: int = 1
    lr: float = 1e-4
    w_dice: float = 1.0
    w_be: float = 0.5
    num_labels: int = 36
    int_steps: int = 7
    workers: int = 4
    amp: bool = False
    val_every: int = 5


class OASISPairs(Dataset):
    def __init__(self, root, split, num_labels):
        with open(os.path.join(root, "OASIS_dataset.json")) as f:
            meta = json.load(f)
        if split == "train":
            subjects = [d["image"] for d in meta["training"]]
            n = len(subjects)
            # all ordered inter-subject pairs of the training set are drawn on the fly
            self.pairs = [(i, (i + k) % n) for i in range(n) for k in (1, 2, 3)]
            self.subjects = subjects
        else:
            self.subjects = None
            self.pairs = [(p["moving"], p["fixed"]) for p in meta["registration_val"]]
        self.root = root
        self.num_labels = num_labels
        self.split = split

    def __len__(self):
        return len(self.pairs)

    def _load(self, img_rel):
        img_path = os.path.join(self.root, img_rel.lstrip("./"))
        img = nib.load(img_path).get_fdata(dtype=np.float32)
        seg = np.asarray(nib.load(img_path.replace("imagesTr", "labelsTr")).dataobj, dtype=np.int64)
        return torch.from_numpy(img)[None], torch.from_numpy(seg)[None]

    def __getitem__(self, idx):
        a, b = self.pairs[idx]
        if self.split == "train":
            a, b = self.subjects[a], self.subjects[b]
        mov, mseg = self._load(a)
        fix, fseg = self._load(b)
        return {"moving": mov, "moving_seg": mseg, "fixed": fix, "fixed_seg": fseg}


class RegNet(nn.Module):
    def __init__(self, int_steps):
        super().__init__()
        self.backbone = UNet(spatial_dims=3, in_channels=2, out_channels=3,
                             channels=(16, 32, 32, 32, 32), strides=(2, 2, 2, 2),
                             num_res_units=0, act=("leakyrelu", {"negative_slope": 0.2}), norm=None)
        self.dvf2ddf = DVF2DDF(num_steps=int_steps, mode="bilinear", padding_mode="zeros")
        self.warp = Warp(mode="bilinear", padding_mode="border")
        self.warp_nearest = Warp(mode="nearest", padding_mode="border")

    def forward(self, moving, fixed):
        dvf = self.backbone(torch.cat([moving, fixed], dim=1))
        ddf = self.dvf2ddf(dvf)
        return self.warp(moving, ddf), ddf


def one_hot(seg, n):
    return F.one_hot(seg[:, 0], n).permute(0, 4, 1, 2, 3).float()


def train_one_epoch(cfg, model, loader, opt, scaler, losses, device, epoch, rank):
    lncc, dice_loss, bending = losses
    model.train()
    meter = torch.zeros(4, device=device)
    t0 = time.time()
    for it, batch in enumerate(loader):
        mov, fix = batch["moving"].to(device), batch["fixed"].to(device)
        mseg = one_hot(batch["moving_seg"].to(device), cfg.num_labels)
        fseg = one_hot(batch["fixed_seg"].to(device), cfg.num_labels)
        with torch.autocast("cuda", dtype=torch.float16, enabled=cfg.amp):
            warped, ddf = model(mov, fix)
            warped_seg = model.warp(mseg, ddf)
            l_sim = lncc(warped.float(), fix)
            l_dice = dice_loss(warped_seg.float(), fseg)
            l_be = bending(ddf.float())
            loss = l_sim + cfg.w_dice * l_dice + cfg.w_be * l_be
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        meter += torch.stack([loss.detach(), l_sim.detach(), l_dice.detach(), torch.ones((), device=device)])
        if rank == 0 and it % 100 == 0:
            print(f"ep {epoch} it {it}/{len(loader)} loss {loss.item():.4f} "
                  f"sim {l_sim.item():.4f} dice {l_dice.item():.4f} be {l_be.item():.5f}", flush=True)
    dist.all_reduce(meter)
    if rank == 0:
        m = (meter[:3] / meter[3]).tolist()
        print(f"== ep {epoch} mean loss {m[0]:.4f} sim {m[1]:.4f} dice {m[2]:.4f} ({time.time() - t0:.0f}s)")


@torch.no_grad()
def validate(cfg, net, val_ds, device, rank, world):
    net.eval()
    metric = DiceMetric(include_background=False, reduction="mean")
    n = 0
    for idx in range(rank, len(val_ds), world):
        b = val_ds[idx]
        mov, fix = b["moving"][None].to(device), b["fixed"][None].to(device)
        _, ddf = net(mov, fix)
        wseg = net.warp_nearest(b["moving_seg"][None].to(device).float(), ddf).long()
        metric(one_hot(wseg, cfg.num_labels), one_hot(b["fixed_seg"][None].to(device), cfg.num_labels))
        n += 1
    local = metric.aggregate().item() if n else 0.0
    stats = torch.tensor([local * n, n], device=device, dtype=torch.float64)
    dist.all_reduce(stats)
    return (stats[0] / stats[1].clamp(min=1)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default=Config.out)
    ap.add_argument("--epochs", type=int, default=Config.epochs)
    ap.add_argument("--lr", type=float, default=Config.lr)
    ap.add_argument("--amp", action="store_true")
    cfg = Config(**vars(ap.parse_args()))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    train_ds = OASISPairs(cfg.root, "train", cfg.num_labels)
    val_ds = OASISPairs(cfg.root, "val", cfg.num_labels)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler,
                        num_workers=cfg.workers, pin_memory=True, persistent_workers=True)

    model = DDP(RegNet(cfg.int_steps).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    scaler = torch.cuda.amp.GradScaler(enabled=cfg.amp)
    losses = (LocalNormalizedCrossCorrelationLoss(spatial_dims=3, kernel_size=9),
              DiceLoss(include_background=False),
              BendingEnergyLoss())

    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
    best = 0.0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        train_one_epoch(cfg, model, loader, opt, scaler, losses, device, epoch, rank)
        if (epoch + 1) % cfg.val_every == 0:
            d = validate(cfg, model.module, val_ds, device, rank, world)
            if rank == 0:
                print(f"== ep {epoch} val dice {d:.4f}", flush=True)
                if d > best:
                    best = d
                    torch.save(model.module.state_dict(), os.path.join(cfg.out, "best.pth"))
        if rank == 0:
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict()},
                       os.path.join(cfg.out, "latest.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
