"""Raster-based ego planner (ResNet-50 on BEV rasters) for nuPlan, in the style of the nuPlan
"raster model" baseline: 224x224 rasters with ego, agents, map and baseline-path channels.

    torchrun --nproc_per_node=8 15_raster_planner.py --raster-root /data/nuplan/rasters_224 \
        --work-dir /data/exp/raster_r50
"""
import argparse
import logging
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.tensorboard import SummaryWriter

NUM_POSES = 16  # 8 s at 2 Hz
RASTER_CHANNELS = 4  # ego, agents, roadmap, baseline paths

log = logging.getLogger("raster_planner")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raster-root", required=True)
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--backbone", default="resnet50")
    ap.add_argument("--pretrained", action="store_true")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=5e-4)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--amp", action="store_true")
    return ap.parse_args()


class RasterScenes(Dataset):
    """Each sample: uint8 raster [4, 224, 224] and the expert trajectory [16, 3] in the ego frame."""

    def __init__(self, root, split, flip_aug=False):
        self.root = os.path.join(root, split)
        self.index = np.load(os.path.join(root, f"{split}_index.npy"), allow_pickle=True)
        self.flip_aug = flip_aug

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        d = np.load(os.path.join(self.root, self.index[i]))
        raster = d["raster"].astype(np.float32) / 255.0
        traj = d["trajectory"].astype(np.float32)
        if self.flip_aug and np.random.rand() < 0.5:
            # mirror left/right: raster columns in ego frame, y and heading of the plan
            raster = raster[:, :, ::-1].copy()
            traj = traj * np.array([1.0, -1.0, -1.0], np.float32)
        return torch.from_numpy(raster), torch.from_numpy(traj)


class RasterPlanner(nn.Module):
    def __init__(self, backbone, pretrained):
        super().__init__()
        self.net = timm.create_model(backbone, pretrained=pretrained, in_chans=RASTER_CHANNELS,
                                     num_classes=0, global_pool="avg")
        self.head = nn.Sequential(nn.Linear(self.net.num_features, 512), nn.ReLU(),
                                  nn.Linear(512, NUM_POSES * 3))

    def forward(self, raster):
        return self.head(self.net(raster)).view(-1, NUM_POSES, 3)


def trajectory_loss(pred, gt):
    xy = F.l1_loss(pred[..., :2], gt[..., :2])
    heading = (1 - torch.cos(pred[..., 2] - gt[..., 2])).mean()
    return xy + 2.0 * heading


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    ade = fde = ahe = n = 0.0
    for raster, traj in loader:
        raster, traj = raster.to(device, non_blocking=True), traj.to(device, non_blocking=True)
        pred = model(raster)
        d = (pred[..., :2] - traj[..., :2]).norm(dim=-1)
        ade += d.mean(-1).sum().item()
        fde += d[:, -1].sum().item()
        ahe += torch.atan2(torch.sin(pred[:, -1, 2] - traj[:, -1, 2]),
                           torch.cos(pred[:, -1, 2] - traj[:, -1, 2])).abs().sum().item()
        n += len(traj)
    model.train()
    return {"ADE": ade / n, "FDE": fde / n, "AHE": ahe / n}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(name)s] %(message)s")

    train_set = RasterScenes(args.raster_root, "train", flip_aug=True)
    val_set = RasterScenes(args.raster_root, "val")
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=128, shuffle=False, num_workers=args.workers,
                            pin_memory=True)

    model = RasterPlanner(args.backbone, args.pretrained)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * world_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader), pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    writer = None
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.work_dir, "tb"))

    best_fde = float("inf")
    global_step = 0
    for epoch in range(args.epochs):
        model.train()
        tic = time.time()
        for raster, traj in train_loader:
            raster = raster.to(device, non_blocking=True)
            traj = traj.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                pred = model(raster)
            loss = trajectory_loss(pred.float(), traj)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            global_step += 1
            if writer is not None and global_step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), global_step)
                writer.add_scalar("train/lr", scheduler.get_last_lr()[0], global_step)
        log.info("epoch %d done in %.0fs", epoch, time.time() - tic)

        # validation on rank 0 only, through the plain module so no collectives are issued
        if rank == 0:
            metrics = evaluate(model.module, val_loader, device)
            log.info("epoch %d val %s", epoch, " ".join(f"{k}={v:.3f}" for k, v in metrics.items()))
            for k, v in metrics.items():
                writer.add_scalar(f"val/{k}", v, epoch)
            ckpt = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "metrics": metrics}
            torch.save(ckpt, os.path.join(args.work_dir, "last.pth"))
            if metrics["FDE"] < best_fde:
                best_fde = metrics["FDE"]
                torch.save(ckpt, os.path.join(args.work_dir, "best.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
