"""Grasp quality network on local point-cloud crops (a point-cloud analogue of GQ-CNN).

Candidates are sampled on simulated single-view clouds of Dex-Net objects; for
each candidate we crop the points within 6 cm of the grasp centre, express them
in the grasp frame and predict the robust grasp quality (label from the
Dex-Net style robust wrench-resistance metric computed in simulation).

Training is long, so it is usually resumed from the last checkpoint:
    torchrun --nproc_per_node=8 14_gqcnn_pointcloud.py --cfg cfg/gqpc.yaml --resume out/gqpc/last.pt
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--cfg", required=True)
    p.add_argument("--resume", default=None)
    p.add_argument("--out", default="out/gqpc")
    return p.parse_args()


class CropDataset(Dataset):
    """Shards of crops: shard_XXXX.npz with arrays crops (M, K, 3), quality (M,)."""

    def __init__(self, root, shards, k_points, quality_thresh):
        self.root = root
        self.k = k_points
        self.thresh = quality_thresh
        self.index = []
        for s in shards:
            n = int(np.load(os.path.join(root, f"{s}_len.npy")))
            self.index.extend((s, j) for j in range(n))
        self._open = {}

    def __len__(self):
        return len(self.index)

    def _arr(self, shard):
        if shard not in self._open:
            self._open[shard] = np.load(os.path.join(self.root, f"{shard}.npz"), mmap_mode="r")
        return self._open[shard]

    def __getitem__(self, i):
        shard, j = self.index[i]
        a = self._arr(shard)
        crop = np.asarray(a["crops"][j], dtype=np.float32)
        q = float(a["quality"][j])
        crop = crop[np.random.permutation(len(crop))[: self.k]]
        if np.random.rand() < 0.5:  # the parallel-jaw gripper is symmetric about its closing plane
            crop[:, 1] = -crop[:, 1]
        return torch.from_numpy(crop), torch.tensor(q > self.thresh, dtype=torch.float32), torch.tensor(q)


class GQPointNet(nn.Module):
    def __init__(self, width=1.0):
        super().__init__()
        c = [int(64 * width), int(128 * width), int(512 * width)]
        self.feat = nn.Sequential(nn.Linear(3, c[0]), nn.LayerNorm(c[0]), nn.ReLU(),
                                  nn.Linear(c[0], c[1]), nn.LayerNorm(c[1]), nn.ReLU(),
                                  nn.Linear(c[1], c[2]))
        self.cls = nn.Sequential(nn.Linear(c[2], 256), nn.ReLU(), nn.Dropout(0.3), nn.Linear(256, 1))

    def forward(self, crop):
        return self.cls(self.feat(crop).max(1)[0]).squeeze(-1)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    s = torch.zeros(5, device=device)  # loss*n, correct, tp, pred_pos, gt_pos
    n = torch.zeros(1, device=device)
    for crop, y, _ in loader:
        crop, y = crop.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logit = model(crop)
        p = (logit > 0).float()
        s[0] += F.binary_cross_entropy_with_logits(logit, y, reduction="sum")
        s[1] += (p == y).sum()
        s[2] += (p * y).sum()
        s[3] += p.sum()
        s[4] += y.sum()
        n += len(y)
    dist.all_reduce(s)
    dist.all_reduce(n)
    model.train()
    return {"loss": (s[0] / n).item(), "acc": (s[1] / n).item(),
            "precision": (s[2] / s[3].clamp(min=1)).item(), "recall": (s[2] / s[4].clamp(min=1)).item()}


def main():
    args = parse_args()
    with open(args.cfg) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg.get("seed", 0))

    shards = sorted(f[:-4] for f in os.listdir(cfg["data"]) if f.endswith(".npz"))
    n_val = max(1, int(len(shards) * cfg.get("val_frac", 0.05)))
    val_shards, train_shards = shards[:n_val], shards[n_val:]

    train_ds = CropDataset(cfg["data"], train_shards, cfg["k_points"], cfg["quality_thresh"])
    val_ds = CropDataset(cfg["data"], val_shards, cfg["k_points"], cfg["quality_thresh"])
    val_ds.index = val_ds.index[rank::world]
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler,
                          num_workers=cfg.get("workers", 8), pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=cfg["batch_size"], num_workers=cfg.get("workers", 8))

    model = GQPointNet(cfg.get("width", 1.0)).to(device)
    lr = cfg["lr"] * cfg["batch_size"] * world / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    total_steps = cfg["epochs"] * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total_steps, pct_start=0.02)

    start_epoch, best_acc = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}", flush=True)

    model = DDP(model, device_ids=[local_rank])

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"), purge_step=start_epoch * len(train_dl))

    pos_w = torch.tensor(cfg.get("pos_weight", 2.0), device=device)
    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (crop, y, _) in enumerate(train_dl):
            crop, y = crop.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(crop), y, pos_weight=pos_w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if step % 200 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l)
                if rank == 0:
                    writer.add_scalar("train/loss", l.item() / world, epoch * len(train_dl) + step)

        metrics = validate(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} {metrics} {time.time() - t0:.0f}s", flush=True)
            for k, v in metrics.items():
                writer.add_scalar(f"val/{k}", v, epoch)
            ckpt = {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "epoch": epoch,
                    "best_acc": max(best_acc, metrics["acc"])}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if metrics["acc"] > best_acc:
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
        best_acc = max(best_acc, metrics["acc"])
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
