"""HRNet-W32 with Gaussian heatmap targets rendered on the GPU.

Rendering 17 Gaussians per crop in the DataLoader workers was the bottleneck
for the 4K broadcast crops, so the dataset now returns joint coordinates in
input space and the targets are rendered on the GPU in one batched op.

    torchrun --nproc_per_node=8 hrnet_gpu_targets.py --data /mnt/datasets/coco --out /mnt/exp/w32_gputgt
"""
import argparse
import json
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from sportpose.data import TopDownCocoDataset
from sportpose.transforms import flip_back, get_final_preds

FLIP_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]


class HeatmapRenderer:
    """Batched Gaussian targets, same convention as the CPU generator (integer-rounded centres)."""

    def __init__(self, image_size=(192, 256), heatmap_size=(48, 64), sigma=2.0, device="cuda:0"):
        self.stride = torch.tensor([image_size[0] / heatmap_size[0], image_size[1] / heatmap_size[1]], device=device)
        self.sigma = sigma
        self.hm_w, self.hm_h = heatmap_size
        self.xs = torch.arange(self.hm_w, dtype=torch.float32, device=device).view(1, 1, 1, -1)
        self.ys = torch.arange(self.hm_h, dtype=torch.float32, device=device).view(1, 1, -1, 1)

    @torch.no_grad()
    def __call__(self, joints, vis):
        # joints: (B, K, 2) in input pixels, vis: (B, K)
        mu = torch.floor(joints / self.stride + 0.5)
        mx, my = mu[..., 0, None, None], mu[..., 1, None, None]
        radius = int(3 * self.sigma)
        inside = (mu[..., 0] - radius < self.hm_w) & (mu[..., 1] - radius < self.hm_h) & \
                 (mu[..., 0] + radius >= 0) & (mu[..., 1] + radius >= 0)
        weight = vis * inside.float()
        g = torch.exp(-((self.xs - mx) ** 2 + (self.ys - my) ** 2) / (2 * self.sigma ** 2))
        window = ((self.xs - mx).abs() <= radius) & ((self.ys - my).abs() <= radius)
        target = g * window * weight[..., None, None]
        return target, weight.unsqueeze(-1)


class HRNetPose(nn.Module):
    def __init__(self, num_joints=17):
        super().__init__()
        self.backbone = timm.create_model("hrnet_w32", pretrained=True, features_only=True,
                                          feature_location="", out_indices=(1,))
        self.final_layer = nn.Conv2d(self.backbone.feature_info.channels()[0], num_joints, 1)

    def forward(self, x):
        return self.final_layer(self.backbone(x)[0])


@torch.no_grad()
def evaluate(model, loader, ds, device, path):
    model.eval()
    rows = []
    for img, _, _, meta in loader:
        img = img.to(device, non_blocking=True)
        hm = model(img)
        hm_f = torch.from_numpy(flip_back(model(img.flip(3)).cpu().numpy(), FLIP_PAIRS).copy()).to(device)
        hm_f[..., 1:] = hm_f.clone()[..., :-1]
        kp, mv = get_final_preds(((hm + hm_f) * 0.5).cpu().numpy(), meta["center"].numpy(), meta["scale"].numpy())
        for n in range(len(kp)):
            ok = mv[n, :, 0] > 0.2
            rows.append({"index": int(meta["index"][n]), "image_id": int(meta["image_id"][n]), "category_id": 1,
                         "keypoints": np.concatenate([kp[n], mv[n]], 1).ravel().tolist(),
                         "score": float(mv[n, ok, 0].mean()) if ok.any() else 0.0})
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, rows)
    if dist.get_rank() != 0:
        return 0.0
    uniq = {r.pop("index"): r for part in parts for r in part}
    with open(path, "w") as f:
        json.dump(list(uniq.values()), f)
    E = COCOeval(ds.coco, ds.coco.loadRes(path), "keypoints")
    E.params.useSegm = None
    E.evaluate(); E.accumulate(); E.summarize()
    return float(E.stats[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/mnt/datasets/coco")
    ap.add_argument("--out", default="/mnt/exp/w32_gputgt")
    ap.add_argument("--epochs", type=int, default=210)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    kw = dict(image_size=[192, 256], flip_pairs=FLIP_PAIRS)
    train_ds = TopDownCocoDataset(args.data, "annotations/person_keypoints_train2017.json", "train2017",
                                  train=True, return_joints=True, **kw)
    val_ds = TopDownCocoDataset(args.data, "annotations/person_keypoints_val2017.json", "val2017",
                                train=False, sigma=2, **kw)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=args.workers, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, 64, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=args.workers,
                        pin_memory=True)

    renderer = HeatmapRenderer(image_size=(192, 256), heatmap_size=(48, 64), sigma=2.0)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(HRNetPose()).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [170, 200], 0.1)

    start, best = 0, 0.0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start, best = ck["epoch"] + 1, ck["best"]

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        meter = torch.zeros(2, device=device)
        for it, (img, joints, vis, _) in enumerate(train_dl):
            img = img.to(device, non_blocking=True)
            joints = joints.to(device, non_blocking=True)
            vis = vis.to(device, non_blocking=True)
            target, weight = renderer(joints, vis)
            out = model(img)
            b, k = out.shape[:2]
            loss = 0.5 * F.mse_loss(out.view(b, k, -1) * weight, target.view(b, k, -1) * weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            meter += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and it % 200 == 0:
                print(f"[{epoch}][{it}/{len(train_dl)}] loss {loss.item():.6f}", flush=True)
        scheduler.step()
        dist.all_reduce(meter)
        if rank == 0:
            print(f"epoch {epoch}: loss {(meter[0] / meter[1]).item():.6f} ({time.time() - t0:.0f}s)", flush=True)

        if (epoch + 1) % 10 == 0:
            ap_val = evaluate(model, val_dl, val_ds, device, os.path.join(args.out, "val_results.json"))
            if rank == 0:
                print(f"epoch {epoch}: AP {ap_val:.4f}", flush=True)
                if ap_val > best:
                    best = ap_val
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        if rank == 0:
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "best": best}, os.path.join(args.out, "latest.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
