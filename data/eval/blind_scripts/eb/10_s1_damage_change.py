"""Sentinel-1 building-damage change detection (pre / post backscatter + coherence).

Input chips (np.float16, 6 channels):
    VV_pre, VH_pre, VV_post, VH_post, coh_pre (pre-pre pair), coh_co (pre-post pair)
Labels: 0 intact, 1 damaged, 255 unknown.  Chips are grouped by AOI (city);
configs/aoi_split.yaml lists which AOIs are train / val / test.

After training, rank 0 writes a damage-probability GeoTIFF for every test AOI
scene with the best model.

    torchrun --nproc_per_node=4 10_s1_damage_change.py --data /data/s1dmg --out runs/s1dmg_dlv3
"""
import argparse
import glob
import os

import numpy as np
import rasterio
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

IN_CH = 6
IGNORE = 255


def normalise(x):
    x = x.astype(np.float32)
    x[:4] = (np.clip(x[:4], -25, 0) + 25) / 25  # dB -> [0, 1]
    x[4:] = np.clip(x[4:], 0, 1)               # coherence already in [0, 1]
    return x


class DamageChips(Dataset):
    def __init__(self, root, aois, train):
        self.files = sorted(f for a in aois for f in glob.glob(os.path.join(root, "chips", a, "*.npz")))
        self.train = train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        z = np.load(self.files[i])
        x, y = normalise(z["x"]), z["y"].astype(np.int64)
        if self.train:
            k = np.random.randint(4)
            x, y = np.rot90(x, k, (1, 2)), np.rot90(y, k)
            if np.random.rand() < 0.5:
                x, y = x[:, :, ::-1], y[:, ::-1]
        return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())


def build_model(encoder):
    return smp.DeepLabV3Plus(encoder, encoder_weights=None, in_channels=IN_CH, classes=2)


@torch.no_grad()
def predict_scene(model, scene_path, out_path, device, tile=512, overlap=64):
    with rasterio.open(scene_path) as src:
        img = normalise(src.read())
        profile = src.profile
    _, h, w = img.shape
    prob = np.zeros((h, w), np.float32)
    weight = np.zeros((h, w), np.float32)
    step = tile - overlap
    for r in range(0, max(1, h - overlap), step):
        for c in range(0, max(1, w - overlap), step):
            r0, c0 = min(r, max(0, h - tile)), min(c, max(0, w - tile))
            patch = torch.from_numpy(img[:, r0:r0 + tile, c0:c0 + tile]).unsqueeze(0).to(device)
            p = model(patch).softmax(1)[0, 1].cpu().numpy()
            prob[r0:r0 + p.shape[0], c0:c0 + p.shape[1]] += p
            weight[r0:r0 + p.shape[0], c0:c0 + p.shape[1]] += 1
    prob /= np.maximum(weight, 1)
    profile.update(count=1, dtype="float32", compress="deflate", tiled=True, blockxsize=512, blockysize=512)
    with rasterio.open(out_path, "w", **profile) as dst:
        dst.write(prob, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--encoder", default="resnet50")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--bs", type=int, default=16, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-4, help="for a global batch of 64")
    ap.add_argument("--split", default="configs/aoi_split.yaml")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    with open(args.split) as f:
        split = yaml.safe_load(f)
    train_ds = DamageChips(args.data, split["train"], train=True)
    val_ds = DamageChips(args.data, split["val"], train=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=8, pin_memory=True,
                              drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), args.bs,
                            num_workers=8, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(build_model(args.encoder)).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.bs * world / 64
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[int(args.epochs * 0.6), int(args.epochs * 0.85)])
    ce_w = torch.tensor([1.0, 8.0], device=device)
    best_ckpt = os.path.join(args.out, "best.pth")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best_f1 = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, weight=ce_w, ignore_index=IGNORE)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        model.eval()
        s = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                pred = model.module(x).argmax(1)
                m = y != IGNORE
                p, t = pred[m] == 1, y[m] == 1
                s += torch.stack([(p & t).sum(), (p & ~t).sum(), (~p & t).sum()]).double()
        dist.all_reduce(s)
        tp, fp, fn = s.tolist()
        f1 = 2 * tp / max(1.0, 2 * tp + fp + fn)
        if rank == 0:
            print(f"epoch {epoch:02d} loss {loss.item():.4f} val damage-F1 {f1:.4f}", flush=True)
            if f1 > best_f1:
                best_f1 = f1
                torch.save({"model": model.state_dict(), "epoch": epoch, "f1": f1, "encoder": args.encoder},
                           best_ckpt)
        dist.barrier()

    dist.destroy_process_group()

    if rank == 0:
        ckpt = torch.load(best_ckpt, map_location=device)
        net = build_model(ckpt["encoder"]).to(device)
        net.load_state_dict(ckpt["model"])
        net.eval()
        pred_dir = os.path.join(args.out, "predictions")
        os.makedirs(pred_dir, exist_ok=True)
        for aoi in split["test"]:
            for scene in sorted(glob.glob(os.path.join(args.data, "scenes", aoi, "*.tif"))):
                out = os.path.join(pred_dir, f"{aoi}_{os.path.basename(scene)}")
                predict_scene(net, scene, out, device)
                print("wrote", out, flush=True)


if __name__ == "__main__":
    main()
