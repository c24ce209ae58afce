"""SimCC (coordinate classification) top-down pose estimation, ResNet-50, COCO 256x192.

Instead of 2D heatmaps each keypoint's x and y are classified into
input_size * split_ratio bins, trained with KL divergence against 1D Gaussians.

    torchrun --nproc_per_node 8 08_simcc_r50_coco.py --out-dir work_dirs/simcc_r50
"""
import argparse
import json
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from pose.data import CocoTopDown
from pose.evaluation import coco_keypoint_eval

INPUT_W, INPUT_H = 192, 256
SPLIT_RATIO = 2.0
SIGMA = (4.9, 5.66)
NUM_JOINTS = 17


class SimCCHead(nn.Module):
    def __init__(self, in_ch, num_joints, feat_hw=(8, 6)):
        super().__init__()
        self.final = nn.Conv2d(in_ch, num_joints, 1)
        flat = feat_hw[0] * feat_hw[1]
        self.mlp_x = nn.Linear(flat, int(INPUT_W * SPLIT_RATIO))
        self.mlp_y = nn.Linear(flat, int(INPUT_H * SPLIT_RATIO))

    def forward(self, feat):
        x = self.final(feat).flatten(2)  # B, K, H*W
        return self.mlp_x(x), self.mlp_y(x)


class SimCCPose(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet50(weights=torchvision.models.ResNet50_Weights.IMAGENET1K_V1)
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        self.head = SimCCHead(2048, NUM_JOINTS)

    def forward(self, x):
        return self.head(self.backbone(x))


def simcc_targets(kpts, vis):
    """kpts: B,K,2 in input pixels -> 1D Gaussian label distributions."""
    device = kpts.device
    xs = torch.arange(int(INPUT_W * SPLIT_RATIO), device=device, dtype=torch.float32)
    ys = torch.arange(int(INPUT_H * SPLIT_RATIO), device=device, dtype=torch.float32)
    mu_x = kpts[..., 0:1] * SPLIT_RATIO
    mu_y = kpts[..., 1:2] * SPLIT_RATIO
    tx = torch.exp(-((xs - mu_x) ** 2) / (2 * SIGMA[0] ** 2))
    ty = torch.exp(-((ys - mu_y) ** 2) / (2 * SIGMA[1] ** 2))
    tx = tx / tx.sum(-1, keepdim=True).clamp(min=1e-6)
    ty = ty / ty.sum(-1, keepdim=True).clamp(min=1e-6)
    inside = (kpts[..., 0] >= 0) & (kpts[..., 0] < INPUT_W) & (kpts[..., 1] >= 0) & (kpts[..., 1] < INPUT_H)
    return tx, ty, (vis > 0) & inside


def kl_loss(pred_x, pred_y, tx, ty, weight, beta=10.0):
    lx = F.kl_div(F.log_softmax(pred_x * beta, -1), tx, reduction="none").sum(-1)
    ly = F.kl_div(F.log_softmax(pred_y * beta, -1), ty, reduction="none").sum(-1)
    w = weight.float()
    return ((lx + ly) * w).sum() / w.sum().clamp(min=1.0)


def decode(pred_x, pred_y):
    vx, ix = pred_x.max(-1)
    vy, iy = pred_y.max(-1)
    coords = torch.stack([ix.float(), iy.float()], -1) / SPLIT_RATIO
    return coords, torch.minimum(vx, vy)


def save_checkpoint(state, is_best, out_dir, filename="checkpoint.pth"):
    path = os.path.join(out_dir, filename)
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, os.path.join(out_dir, "model_best.pth"))


@torch.no_grad()
def evaluate(model, loader, dataset, out_dir, epoch):
    model.eval()
    local = []
    for batch in loader:
        img = batch["img"].cuda(non_blocking=True)
        px, py = model(img)
        fx, fy = model(img.flip(3))
        fx = fx.flip(-1)[:, dataset.flip_index]
        fy = fy[:, dataset.flip_index]
        coords, score = decode((px + fx) / 2, (py + fy) / 2)
        coords = dataset.crop_to_image(coords.cpu().numpy(), batch["center"].numpy(), batch["scale"].numpy())
        score = score.cpu().numpy()
        for i in range(coords.shape[0]):
            local.append({"idx": int(batch["idx"][i]), "image_id": int(batch["image_id"][i]),
                          "keypoints": np.concatenate([coords[i], score[i][:, None]], 1).reshape(-1).tolist(),
                          "bbox_score": float(batch["bbox_score"][i])})
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    ap = torch.zeros(1, device="cuda")
    if dist.get_rank() == 0:
        merged = {r["idx"]: r for p in parts for r in p}
        res_file = os.path.join(out_dir, f"results_{epoch}.json")
        stats = coco_keypoint_eval(dataset.ann_file, list(merged.values()), res_file, rescore=True, oks_nms=0.9)
        print(json.dumps(stats), flush=True)
        ap[0] = stats["AP"]
    dist.broadcast(ap, src=0)
    return ap.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--coco-root", default="data/coco")
    ap.add_argument("--out-dir", default="work_dirs/simcc_r50")
    ap.add_argument("--epochs", type=int, default=140)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    os.makedirs(args.out_dir, exist_ok=True)

    train_set = CocoTopDown(args.coco_root, "train2017", (INPUT_W, INPUT_H), train=True, return_kpts=True)
    val_set = CocoTopDown(args.coco_root, "val2017", (INPUT_W, INPUT_H), train=False, use_det_boxes=True)
    sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, 128, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    model = SimCCPose().cuda()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    iters = len(train_loader)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1e-3, total_iters=1000)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * iters - 1000, eta_min=args.lr * 0.05)
    sched = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[1000])

    start_epoch, best_ap = 0, 0.0
    resume = os.path.join(args.out_dir, "checkpoint.pth")
    if os.path.isfile(resume):
        ckpt = torch.load(resume, map_location="cpu")
        model.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        start_epoch, best_ap = ckpt["epoch"], ckpt["best_ap"]

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, batch in enumerate(train_loader):
            img = batch["img"].cuda(non_blocking=True)
            kpts = batch["kpts"].cuda(non_blocking=True)
            vis = batch["vis"].cuda(non_blocking=True)
            tx, ty, w = simcc_targets(kpts, vis)
            px, py = model(img)
            loss = kl_loss(px, py, tx, ty, w)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"[{epoch}][{it}/{iters}] loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / (it + 1):.3f}s/it", flush=True)

        ap = 0.0
        if (epoch + 1) % 10 == 0 or epoch + 1 == args.epochs:
            ap = evaluate(model, val_loader, val_set, args.out_dir, epoch + 1)
        is_best = ap > best_ap
        best_ap = max(ap, best_ap)
        save_checkpoint({"epoch": epoch + 1, "state_dict": model.module.state_dict(), "best_ap": best_ap,
                         "optimizer": optimizer.state_dict(), "scheduler": sched.state_dict()},
                        is_best, args.out_dir)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
