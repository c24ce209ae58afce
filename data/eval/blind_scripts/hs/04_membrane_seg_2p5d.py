"""2.5D membrane segmentation for cryo-ET.

Input: a stack of 5 neighbouring z-slices of a (bin4, denoised) tomogram as channels;
target: the membrane mask of the central slice.  Uses a ResNet34 U-Net from
segmentation_models_pytorch with ImageNet weights (first conv re-initialised for 5 ch).

Run on the lab node:
    torchrun --nproc_per_node=4 04_membrane_seg_2p5d.py -c configs/membrane_2p5d.yaml
"""
import argparse
import json
import os
import time
from dataclasses import dataclass, field, asdict
from typing import List

import mrcfile
import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class Config:
    root: str = "/data/cryoet/membranes"
    train_tomos: List[str] = field(default_factory=list)
    val_tomos: List[str] = field(default_factory=list)
    out_dir: str = "runs/membrane_2p5d"
    context: int = 2
    crop: int = 384
    batch_size: int = 8          # per GPU
    epochs: int = 50
    lr: float = 3e-4
    weight_decay: float = 1e-4
    workers: int = 6
    pos_weight: float = 3.0
    save_every: int = 5


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("--resume", default=None)
    a = ap.parse_args()
    with open(a.config) as f:
        cfg = Config(**yaml.safe_load(f))
    return cfg, a.resume


def read_mrc(path):
    with mrcfile.open(path, permissive=True) as m:
        return np.asarray(m.data, dtype=np.float32)


class SliceStackDataset(Dataset):
    def __init__(self, root, names, context, crop, train):
        self.context, self.crop, self.train = context, crop, train
        self.tomos, self.masks, self.items = [], [], []
        for t, name in enumerate(names):
            vol = read_mrc(os.path.join(root, name, f"{name}.mrc"))
            vol = (vol - vol.mean()) / (vol.std() + 1e-6)
            mask = read_mrc(os.path.join(root, name, f"{name}_membranes.mrc")) > 0.5
            self.tomos.append(vol)
            self.masks.append(mask)
            # only slices with annotated membrane in the central 80%
            nz = vol.shape[0]
            for z in range(max(context, int(0.1 * nz)), min(nz - context, int(0.9 * nz))):
                self.items.append((t, z))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        t, z = self.items[i]
        vol, mask = self.tomos[t], self.masks[t]
        c = self.context
        img = vol[z - c:z + c + 1]
        tgt = mask[z].astype(np.float32)
        _, h, w = img.shape
        s = min(self.crop, h, w)
        if self.train:
            y0, x0 = np.random.randint(0, h - s + 1), np.random.randint(0, w - s + 1)
        else:
            y0, x0 = (h - s) // 2, (w - s) // 2
        img, tgt = img[:, y0:y0 + s, x0:x0 + s], tgt[y0:y0 + s, x0:x0 + s]
        if self.train:
            k = np.random.randint(4)
            img, tgt = np.rot90(img, k, axes=(1, 2)), np.rot90(tgt, k)
            if np.random.rand() < 0.5:
                img, tgt = img[::-1], tgt  # flip along z
        return torch.from_numpy(np.ascontiguousarray(img)), torch.from_numpy(np.ascontiguousarray(tgt))[None]


def seg_loss(logits, target, pos_weight):
    bce = F.binary_cross_entropy_with_logits(
        logits, target, pos_weight=torch.tensor(pos_weight, device=logits.device))
    p = torch.sigmoid(logits)
    num = 2 * (p * target).sum((2, 3)) + 1
    den = p.sum((2, 3)) + target.sum((2, 3)) + 1
    return bce + (1 - num / den).mean()


def worker_init(worker_id):
    seed = torch.initial_seed() % 2 ** 32
    np.random.seed(seed + worker_id)


def main():
    cfg, resume = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    main_proc = rank == 0

    train_ds = SliceStackDataset(cfg.root, cfg.train_tomos, cfg.context, cfg.crop, True)
    val_ds = SliceStackDataset(cfg.root, cfg.val_tomos, cfg.context, cfg.crop, False)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler,
                              num_workers=cfg.workers, pin_memory=True, drop_last=True,
                              worker_init_fn=worker_init)
    # every rank scores a disjoint strided part of the validation slices (no padding)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=cfg.batch_size, num_workers=2)

    model = smp.Unet("resnet34", encoder_weights="imagenet", in_channels=2 * cfg.context + 1, classes=1)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs * len(train_loader))
    start_epoch = 0
    if resume:
        ckpt = torch.load(resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch = ckpt["epoch"] + 1

    if main_proc:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=2)
        print(f"train slices {len(train_ds)}, val slices {len(val_ds)}, world {world}", flush=True)

    for epoch in range(start_epoch, cfg.epochs):
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for img, tgt in train_loader:
            img = img.to(device, non_blocking=True)
            tgt = tgt.to(device, non_blocking=True)
            loss = seg_loss(model(img), tgt, cfg.pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])

        model.eval()
        conf = torch.zeros(3, device=device)  # tp, fp, fn
        with torch.no_grad():
            for img, tgt in val_loader:
                img, tgt = img.to(device), tgt.to(device)
                pred = model(img) > 0
                gt = tgt > 0.5
                conf[0] += (pred & gt).sum()
                conf[1] += (pred & ~gt).sum()
                conf[2] += (~pred & gt).sum()
        dist.all_reduce(loss_sum)
        dist.all_reduce(conf)
        f1 = (2 * conf[0] / (2 * conf[0] + conf[1] + conf[2]).clamp(min=1)).item()

        if main_proc:
            print(f"epoch {epoch:03d} loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"val F1 {f1:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if (epoch + 1) % cfg.save_every == 0 or epoch == cfg.epochs - 1:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "epoch": epoch, "f1": f1},
                           os.path.join(cfg.out_dir, f"ckpt_{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
