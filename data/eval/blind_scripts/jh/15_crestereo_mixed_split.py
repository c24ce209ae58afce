"""CREStereo training on a mixture of stereo sets with different native resolutions
(CREStereo synthetic 1920x1080, Middlebury ~3000x2000, ETH3D ~940x490, InStereo2K
1080x860). Every sample is rescaled and cropped to one training size. 3% of each
set is held out for validation.

    torchrun --nproc_per_node=8 15_crestereo_mixed_split.py --config cfgs/mixed.yaml
"""
import argparse
import json
import os
import random
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from nets.crestereo import CREStereo
from utils.io import read_disparity  # handles .pfm / .png(16 bit) / crestereo .disp.png


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_split(manifest_files, val_fraction):
    """Each manifest is a JSON list of {left, right, disp} records."""
    train, val = [], []
    for path in manifest_files:
        with open(path) as f:
            records = json.load(f)
        random.shuffle(records)
        n_val = max(1, int(len(records) * val_fraction))
        val.extend(records[:n_val])
        train.extend(records[n_val:])
    return train, val


class MixedStereo(Dataset):
    def __init__(self, records, crop_hw, train=True, max_disp=256):
        self.records = records
        self.crop_hw = crop_hw
        self.train = train
        self.max_disp = max_disp

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        r = self.records[i]
        left = cv2.imread(r["left"], cv2.IMREAD_COLOR)[..., ::-1].astype(np.float32)
        right = cv2.imread(r["right"], cv2.IMREAD_COLOR)[..., ::-1].astype(np.float32)
        disp = read_disparity(r["disp"]).astype(np.float32)
        ch, cw = self.crop_hw
        h, w = disp.shape
        # bring every source to roughly the crop scale first (disparity scales with width)
        s = max(ch / h, cw / w) * (np.random.uniform(1.0, 1.6) if self.train else 1.0)
        nh, nw = int(np.ceil(h * s)), int(np.ceil(w * s))
        left = cv2.resize(left, (nw, nh), interpolation=cv2.INTER_LINEAR)
        right = cv2.resize(right, (nw, nh), interpolation=cv2.INTER_LINEAR)
        disp = cv2.resize(disp, (nw, nh), interpolation=cv2.INTER_NEAREST) * (nw / w)
        if self.train:
            y = np.random.randint(0, nh - ch + 1)
            x = np.random.randint(0, nw - cw + 1)
        else:
            y, x = (nh - ch) // 2, (nw - cw) // 2
        left, right = left[y:y + ch, x:x + cw], right[y:y + ch, x:x + cw]
        disp = disp[y:y + ch, x:x + cw]
        valid = (disp > 0) & (disp < self.max_disp) & np.isfinite(disp)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a))
        return t(left).permute(2, 0, 1), t(right).permute(2, 0, 1), t(disp)[None], t(valid.astype(np.float32))


def sequence_loss(preds, gt, valid, gamma=0.8):
    n = len(preds)
    valid = valid[:, None].bool()
    loss = 0.0
    for i, p in enumerate(preds):
        # CREStereo predicts flow-like (2-channel) output; x component is -disparity
        p = -p[:, :1] if p.shape[1] == 2 else p
        loss = loss + gamma ** (n - i - 1) * (p - gt).abs()[valid].mean()
    return loss


@torch.no_grad()
def validate(model, loader, device, iters):
    model.eval()
    acc = torch.zeros(4, dtype=torch.float64, device=device)
    for left, right, disp, valid in loader:
        left, right, disp, valid = left.to(device), right.to(device), disp.to(device), valid.to(device).bool()
        flow = model(left, right, iters=iters, test_mode=True)
        pred = -flow[:, :1]
        err = (pred - disp).abs()[:, 0][valid]
        acc += torch.stack([err.sum(), (err > 1).sum(), (err > 3).sum(), valid.sum()]).double()
    dist.all_reduce(acc)
    model.train()
    n = acc[3].clamp(min=1)
    return {"epe": (acc[0] / n).item(), "bad1": (100 * acc[1] / n).item(), "bad3": (100 * acc[2] / n).item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_seed(cfg.get("seed", 0) + rank)  # different augmentation stream per rank

    train_records, val_records = build_split(cfg["manifests"], cfg.get("val_fraction", 0.03))
    crop = tuple(cfg.get("crop", [384, 512]))
    train_set = MixedStereo(train_records, crop, train=True, max_disp=cfg.get("max_disp", 256))
    val_set = MixedStereo(val_records, crop, train=False, max_disp=cfg.get("max_disp", 256))
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, cfg.get("batch_size", 2), sampler=train_sampler,
                              num_workers=cfg.get("workers", 6), pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, 4, sampler=val_sampler, num_workers=2)

    model = CREStereo(max_disp=cfg.get("max_disp", 256), mixed_precision=False, test_mode=False).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.get("lr", 4e-4), betas=(0.9, 0.999),
                                  weight_decay=cfg.get("weight_decay", 1e-5))
    total_steps = cfg.get("num_steps", 300000)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, cfg.get("lr", 4e-4), total_steps + 100,
                                                    pct_start=0.02, cycle_momentum=False,
                                                    anneal_strategy="linear")
    out_dir = cfg.get("out_dir", "runs/crestereo_mixed")
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        print(f"train {len(train_set)} / val {len(val_set)} samples on {world} GPUs", flush=True)

    step, epoch = 0, 0
    t0 = time.time()
    model.train()
    while step < total_steps:
        train_sampler.set_epoch(epoch)
        for left, right, disp, valid in train_loader:
            left, right = left.to(device, non_blocking=True), right.to(device, non_blocking=True)
            disp, valid = disp.to(device, non_blocking=True), valid.to(device, non_blocking=True)
            preds = model(left, right, iters=cfg.get("train_iters", 10))
            loss = sequence_loss(preds, disp, valid)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"step {step} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e} "
                      f"{time.time() - t0:.0f}s", flush=True)
                t0 = time.time()
            if step % cfg.get("val_every", 10000) == 0:
                metrics = validate(model.module, val_loader, device, cfg.get("val_iters", 20))
                if rank == 0:
                    print(f"step {step} val {metrics}", flush=True)
                    torch.save({"step": step, "model": model.module.state_dict(),
                                "optimizer": optimizer.state_dict()},
                               os.path.join(out_dir, f"crestereo_{step:06d}.pth"))
                dist.barrier()
            if step >= total_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
