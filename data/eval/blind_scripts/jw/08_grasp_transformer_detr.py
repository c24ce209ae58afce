"""Transformer grasp detector on object-centric point patches.

The scene cloud is grouped into patches (FPS + kNN), each patch becomes a token,
and a transformer decoder with learned queries predicts a set of grasps
(position, rotation 6D, width, confidence) matched to simulation-verified grasps
with the Hungarian algorithm.

    torchrun --nnodes=1 --nproc_per_node=4 08_grasp_transformer_detr.py \
        --data-root /data/grasp_sim/scenes --output-dir /data/exp/grasp_tr
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--num-points", type=int, default=8192)
    p.add_argument("--num-patches", type=int, default=256)
    p.add_argument("--patch-size", type=int, default=32)
    p.add_argument("--num-queries", type=int, default=100)
    p.add_argument("--max-gt", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class GraspSceneDataset(Dataset):
    def __init__(self, root, split, num_points, max_gt):
        self.dir = os.path.join(root, split)
        self.files = sorted(f for f in os.listdir(self.dir) if f.endswith(".npz"))
        self.num_points = num_points
        self.max_gt = max_gt

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(os.path.join(self.dir, self.files[i]))
        pts = d["points"]
        pts = pts[np.random.choice(len(pts), self.num_points, replace=len(pts) < self.num_points)]
        grasps = d["grasps"]  # (G, 10): xyz, rot6d, width
        grasps = grasps[d["success"] > 0]
        if len(grasps) > self.max_gt:
            grasps = grasps[np.random.choice(len(grasps), self.max_gt, replace=False)]
        gt = np.zeros((self.max_gt, 10), np.float32)
        gt[: len(grasps)] = grasps
        return torch.from_numpy(pts.astype(np.float32)), torch.from_numpy(gt), len(grasps)


def fps(xyz, m):
    B, N, _ = xyz.shape
    idx = torch.zeros(B, m, dtype=torch.long, device=xyz.device)
    dist_ = torch.full((B, N), 1e10, device=xyz.device)
    far = torch.randint(0, N, (B,), device=xyz.device)
    ar = torch.arange(B, device=xyz.device)
    for i in range(m):
        idx[:, i] = far
        c = xyz[ar, far][:, None]
        dist_ = torch.minimum(dist_, ((xyz - c) ** 2).sum(-1))
        far = dist_.argmax(-1)
    return idx


class PatchTokenizer(nn.Module):
    def __init__(self, num_patches, patch_size, dim):
        super().__init__()
        self.m, self.k = num_patches, patch_size
        self.mlp = nn.Sequential(nn.Linear(3, 128), nn.GELU(), nn.Linear(128, dim))
        self.pos = nn.Sequential(nn.Linear(3, 128), nn.GELU(), nn.Linear(128, dim))

    def forward(self, xyz):
        B = xyz.shape[0]
        centers = torch.gather(xyz, 1, fps(xyz, self.m)[..., None].expand(-1, -1, 3))
        knn = torch.cdist(centers, xyz).topk(self.k, largest=False).indices
        patches = torch.gather(xyz[:, None].expand(-1, self.m, -1, -1), 2, knn[..., None].expand(-1, -1, -1, 3))
        patches = patches - centers[:, :, None]
        tokens = self.mlp(patches).max(2)[0] + self.pos(centers)
        return tokens, centers


class GraspTransformer(nn.Module):
    def __init__(self, args, dim=256):
        super().__init__()
        self.tok = PatchTokenizer(args.num_patches, args.patch_size, dim)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(dim, 8, 1024, 0.1, batch_first=True), 4)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(dim, 8, 1024, 0.1, batch_first=True), 4)
        self.queries = nn.Embedding(args.num_queries, dim)
        self.grasp_head = nn.Linear(dim, 10)
        self.conf_head = nn.Linear(dim, 1)

    def forward(self, xyz):
        tokens, _ = self.tok(xyz)
        mem = self.encoder(tokens)
        q = self.decoder(self.queries.weight[None].expand(xyz.shape[0], -1, -1), mem)
        return self.grasp_head(q), self.conf_head(q).squeeze(-1)


def set_loss(pred, conf, gt, n_gt):
    losses = []
    for b in range(pred.shape[0]):
        n = int(n_gt[b])
        target = torch.zeros_like(conf[b])
        if n == 0:
            losses.append(F.binary_cross_entropy_with_logits(conf[b], target) + pred[b].sum() * 0)
            continue
        g = gt[b, :n]
        cost = torch.cdist(pred[b, :, :3], g[:, :3]) + 0.1 * torch.cdist(pred[b, :, 3:9], g[:, 3:9])
        qi, gi = linear_sum_assignment(cost.detach().cpu().numpy())
        qi, gi = torch.as_tensor(qi, device=pred.device), torch.as_tensor(gi, device=pred.device)
        target[qi] = 1.0
        reg = F.l1_loss(pred[b, qi], g[gi])
        losses.append(F.binary_cross_entropy_with_logits(conf[b], target) + 5.0 * reg)
    return torch.stack(losses).mean()


def save_checkpoint(path, model, optimizer, scheduler, epoch, best):
    torch.save({
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "epoch": epoch,
        "best_val": best,
    }, path)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    dist.barrier()

    train_set = GraspSceneDataset(args.data_root, "train", args.num_points, args.max_gt)
    val_set = GraspSceneDataset(args.data_root, "val", args.num_points, args.max_gt)
    val_set.files = val_set.files[rank::world]
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, args.batch_size, shuffle=False, num_workers=args.workers)

    model = GraspTransformer(args).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    ckpt_path = os.path.join(args.output_dir, "checkpoint.pth")
    start_epoch, best_val = 0, float("inf")
    if args.resume and os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_val = ckpt["epoch"] + 1, ckpt["best_val"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        run = torch.zeros(2, device=device)
        for pts, gt, n_gt in train_loader:
            pts, gt = pts.to(device, non_blocking=True), gt.to(device, non_blocking=True)
            pred, conf = model(pts)
            loss = set_loss(pred, conf, gt, n_gt)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            optimizer.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()

        model.eval()
        val = torch.zeros(2, device=device)
        with torch.no_grad():
            for pts, gt, n_gt in val_loader:
                pts, gt = pts.to(device), gt.to(device)
                pred, conf = model.module(pts)
                val += torch.stack([set_loss(pred, conf, gt, n_gt) * pts.shape[0],
                                    torch.tensor(float(pts.shape[0]), device=device)])
        dist.all_reduce(run)
        dist.all_reduce(val)
        train_loss, val_loss = (run[0] / run[1]).item(), (val[0] / val[1]).item()
        if rank == 0:
            print(f"epoch {epoch}: train {train_loss:.4f} val {val_loss:.4f} "
                  f"lr {scheduler.get_last_lr()[0]:.2e} ({time.time() - tic:.0f}s)", flush=True)

        if val_loss < best_val:
            best_val = val_loss
            save_checkpoint(os.path.join(args.output_dir, "best.pth"), model, optimizer, scheduler, epoch, best_val)
        save_checkpoint(ckpt_path, model, optimizer, scheduler, epoch, best_val)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
