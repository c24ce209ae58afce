"""Train a PointNet++-style grasp detector on GraspNet-1Billion scenes.

Each sample is a single-view point cloud of a cluttered scene together with the
simulation-annotated grasp labels (per-point graspness, approach view, in-plane
angle bin and gripper width).

Launch:
    torchrun --nproc_per_node=8 01_graspnet_pointnet2.py --data_root /datasets/graspnet
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("graspnet")

NUM_VIEWS = 300
NUM_ANGLES = 12


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", type=str, required=True)
    p.add_argument("--camera", type=str, default="realsense", choices=["realsense", "kinect"])
    p.add_argument("--num_points", type=int, default=20000)
    p.add_argument("--batch_size", type=int, default=4, help="per GPU")
    p.add_argument("--epochs", type=int, default=18)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--out_dir", type=str, default="runs/graspnet_pn2")
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class GraspNetScenes(Dataset):
    """Scenes 0-99 are train, 100-189 are test (seen/similar/novel)."""

    def __init__(self, root, camera, split, num_points, augment):
        self.root = root
        self.camera = camera
        self.num_points = num_points
        self.augment = augment
        scene_ids = range(0, 100) if split == "train" else range(100, 130)
        self.items = []
        for sid in scene_ids:
            scene_dir = os.path.join(root, "clean", f"scene_{sid:04d}", camera)
            for ann in range(256):
                self.items.append(os.path.join(scene_dir, f"{ann:04d}.npz"))

    def __len__(self):
        return len(self.items)

    def _sample(self, n):
        if n >= self.num_points:
            return np.random.choice(n, self.num_points, replace=False)
        extra = np.random.choice(n, self.num_points - n, replace=True)
        return np.concatenate([np.arange(n), extra])

    def __getitem__(self, idx):
        d = np.load(self.items[idx])
        pts = d["points"].astype(np.float32)
        idxs = self._sample(len(pts))
        pts = pts[idxs]
        graspness = d["graspness"][idxs].astype(np.float32)
        view = d["view_label"][idxs].astype(np.int64)
        angle = d["angle_label"][idxs].astype(np.int64)
        width = d["width_label"][idxs].astype(np.float32)
        if self.augment:
            # random flip about the YZ plane and rotation about the camera z axis
            if np.random.rand() > 0.5:
                pts[:, 0] = -pts[:, 0]
            theta = np.random.uniform(-np.pi / 6, np.pi / 6)
            c, s = np.cos(theta), np.sin(theta)
            rot = np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]], dtype=np.float32)
            pts = pts @ rot.T
        return {
            "points": torch.from_numpy(pts),
            "graspness": torch.from_numpy(graspness),
            "view": torch.from_numpy(view),
            "angle": torch.from_numpy(angle),
            "width": torch.from_numpy(width),
        }


class SharedMLP(nn.Sequential):
    def __init__(self, dims):
        layers = []
        for i in range(len(dims) - 1):
            layers += [nn.Conv1d(dims[i], dims[i + 1], 1), nn.GroupNorm(8, dims[i + 1]), nn.ReLU(inplace=True)]
        super().__init__(*layers)


class PointGraspNet(nn.Module):
    """Per-point backbone + heads; a small stand-in for the PointNet++ SA/FP stack."""

    def __init__(self, feat_dim=256):
        super().__init__()
        self.local = SharedMLP([3, 64, 128, feat_dim])
        self.global_mlp = SharedMLP([feat_dim, 512, 1024])
        self.fuse = SharedMLP([feat_dim + 1024, 512, feat_dim])
        self.graspness_head = nn.Conv1d(feat_dim, 1, 1)
        self.view_head = nn.Conv1d(feat_dim, NUM_VIEWS, 1)
        self.angle_head = nn.Conv1d(feat_dim, NUM_ANGLES, 1)
        self.width_head = nn.Conv1d(feat_dim, NUM_ANGLES, 1)

    def forward(self, points):
        x = points.transpose(1, 2)  # B,3,N
        local = self.local(x)
        g = self.global_mlp(local).max(dim=2, keepdim=True)[0]
        feat = self.fuse(torch.cat([local, g.expand(-1, -1, local.shape[2])], dim=1))
        return {
            "graspness": self.graspness_head(feat).squeeze(1),
            "view": self.view_head(feat),
            "angle": self.angle_head(feat),
            "width": self.width_head(feat),
        }


def compute_loss(out, batch):
    l_g = F.smooth_l1_loss(out["graspness"], batch["graspness"])
    mask = batch["graspness"] > 0.1
    if mask.any():
        view_logits = out["view"].transpose(1, 2)[mask]
        angle_logits = out["angle"].transpose(1, 2)[mask]
        widths = out["width"].transpose(1, 2)[mask]
        ang = batch["angle"][mask]
        l_v = F.cross_entropy(view_logits, batch["view"][mask])
        l_a = F.cross_entropy(angle_logits, ang)
        pred_w = widths.gather(1, ang.unsqueeze(1)).squeeze(1)
        l_w = F.smooth_l1_loss(pred_w, batch["width"][mask])
    else:
        zero = out["view"].sum() * 0.0 + out["angle"].sum() * 0.0 + out["width"].sum() * 0.0
        l_v = l_a = l_w = zero
    total = 10.0 * l_g + l_v + l_a + 10.0 * l_w
    return total, {"graspness": l_g.detach(), "view": l_v.detach(), "angle": l_a.detach(), "width": l_w.detach()}


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    sums = torch.zeros(3, device=device)  # angle-correct, positives, loss
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        out = model(batch["points"])
        loss, _ = compute_loss(out, batch)
        mask = batch["graspness"] > 0.1
        pred_angle = out["angle"].argmax(1)
        sums[0] += (pred_angle[mask] == batch["angle"][mask]).sum()
        sums[1] += mask.sum()
        sums[2] += loss * batch["points"].shape[0]
    # loader covers rank-strided scenes, so no padded duplicates
    counts = torch.tensor([float(len(loader.dataset))], device=device)
    dist.all_reduce(sums)
    dist.all_reduce(counts)
    model.train()
    return (sums[0] / sums[1].clamp(min=1)).item(), (sums[2] / counts[0]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    train_set = GraspNetScenes(args.data_root, args.camera, "train", args.num_points, augment=True)
    test_set = GraspNetScenes(args.data_root, args.camera, "test", args.num_points, augment=False)
    test_set.items = test_set.items[rank::world_size]

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    test_loader = DataLoader(test_set, batch_size=args.batch_size, shuffle=False,
                             num_workers=args.workers, pin_memory=True)

    model = PointGraspNet().to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    lr = args.lr * world_size * args.batch_size / 4
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    steps_per_epoch = len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=args.epochs * steps_per_epoch,
                                                    pct_start=0.05)

    best_acc = 0.0
    global_step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for it, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            out = model(batch["points"])
            loss, parts = compute_loss(out, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            global_step += 1

            running[0] += loss.detach()
            running[1] += 1
            if (it + 1) % args.log_every == 0:
                dist.all_reduce(running)
                if rank == 0:
                    logger.info("epoch %d it %d/%d loss %.4f g %.4f v %.4f a %.4f w %.4f lr %.2e",
                                epoch, it + 1, steps_per_epoch, (running[0] / running[1]).item(),
                                parts["graspness"].item(), parts["view"].item(), parts["angle"].item(),
                                parts["width"].item(), scheduler.get_last_lr()[0])
                running.zero_()

        acc, test_loss = evaluate(model, test_loader, device)
        if rank == 0:
            logger.info("epoch %d done in %.0fs | test angle acc %.4f loss %.4f", epoch, time.time() - t0, acc, test_loss)
            state = {
                "epoch": epoch,
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "acc": acc,
            }
            torch.save(state, os.path.join(args.out_dir, "last.pth"))
            if acc > best_acc:
                best_acc = acc
                torch.save(state, os.path.join(args.out_dir, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
