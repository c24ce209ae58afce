"""
Canopy height regression from Sentinel-2 (10 bands) supervised by sparse GEDI RH98 footprints.

Each training sample is a 256x256 S2 patch (10 m) and a same-size raster of GEDI heights
(NaN where there is no footprint). The loss is computed only on footprint pixels.

    srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=4 \
        torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 \
        13_canopy_height.py --data /gpfs/chm/patches --out /gpfs/chm/runs/unet_rh98
"""
import argparse
import glob
import os
import time

import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

# per-band statistics of the training patches (B2 B3 B4 B5 B6 B7 B8 B8A B11 B12), reflectance * 1e4
S2_MEAN = torch.tensor([480.3, 720.9, 650.2, 1080.4, 2120.7, 2510.1, 2690.5, 2790.3, 1920.6, 1120.8]).view(1, -1, 1, 1).cuda()
S2_STD = torch.tensor([310.5, 350.2, 420.8, 450.1, 620.3, 760.9, 810.4, 830.7, 690.2, 590.6]).view(1, -1, 1, 1).cuda()
MAX_HEIGHT = 60.0


class GEDIPatches(Dataset):
    """<root>/<split>/*.npz with keys 's2' (10, 256, 256) uint16 and 'rh98' (256, 256) float32 (NaN = no shot)."""

    def __init__(self, root, split, augment):
        self.files = sorted(glob.glob(os.path.join(root, split, "*.npz")))
        self.augment = augment

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with np.load(self.files[i]) as z:
            s2 = z["s2"].astype(np.float32)
            rh = z["rh98"].astype(np.float32)
        if self.augment:
            k = np.random.randint(4)
            s2, rh = np.rot90(s2, k, axes=(1, 2)), np.rot90(rh, k)
            if np.random.rand() < 0.5:
                s2, rh = s2[:, :, ::-1], rh[:, ::-1]
        return torch.from_numpy(s2.copy()), torch.from_numpy(rh.copy())


def masked_losses(pred, target):
    valid = torch.isfinite(target)
    if valid.any():
        diff = pred[valid] - target[valid]
    else:
        diff = pred.sum() * 0.0  # keep the graph connected for an empty patch batch
    return diff, valid.sum()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--encoder", default="resnet50")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=10)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = GEDIPatches(args.data, "train", augment=True)
    val_set = GEDIPatches(args.data, "val", augment=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = smp.Unet(args.encoder, encoder_weights=None, in_channels=10, classes=1, activation=None)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader))
    huber = nn.HuberLoss(delta=3.0, reduction="sum")

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train {len(train_set)} val {len(val_set)} world {world}", flush=True)

    best_rmse = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for s2, rh in train_loader:
            s2 = s2.to(device, non_blocking=True)
            rh = rh.to(device, non_blocking=True)
            x = (s2 - S2_MEAN) / S2_STD
            pred = model(x).squeeze(1) * MAX_HEIGHT
            diff, n = masked_losses(pred, rh)
            # normalise by the number of footprints in the global batch, not the local one
            n_global = n.float().clone()
            dist.all_reduce(n_global)
            loss = huber(diff, torch.zeros_like(diff)) * world / n_global.clamp(min=1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            tot += torch.stack([loss.detach() * n_global / world, n.float()])
        dist.all_reduce(tot)

        model.eval()
        err = torch.zeros(3, device=device, dtype=torch.float64)  # sum sq, sum abs, count
        with torch.no_grad():
            for s2, rh in val_loader:
                s2, rh = s2.to(device, non_blocking=True), rh.to(device, non_blocking=True)
                pred = model((s2 - S2_MEAN) / S2_STD).squeeze(1) * MAX_HEIGHT
                valid = torch.isfinite(rh)
                d = (pred[valid] - rh[valid]).double()
                err += torch.stack([(d ** 2).sum(), d.abs().sum(), torch.tensor(float(d.numel()), device=device,
                                                                                  dtype=torch.float64)])
        dist.all_reduce(err)
        rmse = (err[0] / err[2].clamp(min=1)).sqrt().item()
        mae = (err[1] / err[2].clamp(min=1)).item()

        if rank == 0:
            print(f"epoch {epoch:02d} train_huber {(tot[0] / tot[1].clamp(min=1)).item():.3f} "
                  f"val_rmse {rmse:.2f} m val_mae {mae:.2f} m ({time.time() - t0:.0f}s)", flush=True)
            ckpt = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "rmse": rmse}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if rmse < best_rmse:
                best_rmse = rmse
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
