"""HRNet-W32 with a second-stage heatmap refiner (coarse -> refine).

The refiner takes the coarse heatmaps + stride-4 features and predicts a
residual correction; it is switched on after the coarse head has converged
(--refine-start), which made training of the refiner much more stable for
the fast-motion (sprint / hurdles) clips.

    torchrun --nproc_per_node=4 hrnet_refine_stage.py --data /mnt/athletics --out /mnt/athletics/exp/w32_refine
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


class RefineBlock(nn.Module):
    def __init__(self, feat_ch, num_joints, mid=64):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(feat_ch + num_joints, mid, 3, padding=1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
            nn.Conv2d(mid, mid, 3, padding=2, dilation=2, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
            nn.Conv2d(mid, num_joints, 1))
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, feat, coarse):
        return coarse + self.net(torch.cat([feat, coarse], dim=1))


class HRNetRefine(nn.Module):
    def __init__(self, num_joints=17):
        super().__init__()
        self.backbone = timm.create_model("hrnet_w32", pretrained=True, features_only=True,
                                          feature_location="", out_indices=(1,))
        ch = self.backbone.feature_info.channels()[0]
        self.coarse_head = nn.Conv2d(ch, num_joints, 1)
        self.refiner = RefineBlock(ch, num_joints)

    def forward(self, x, refine=True):
        feat = self.backbone(x)[0]
        coarse = self.coarse_head(feat)
        if not refine:
            return coarse, None
        return coarse, self.refiner(feat, coarse.detach())


def weighted_mse(pred, target, weight):
    b, k = pred.shape[:2]
    return 0.5 * F.mse_loss(pred.reshape(b, k, -1) * weight, target.reshape(b, k, -1) * weight)


@torch.no_grad()
def evaluate(model, loader, ds, device, path, refine):
    model.eval()
    rows = []
    for img, _, _, meta in loader:
        img = img.to(device, non_blocking=True)
        c, r = model(img, refine=refine)
        hm = r if refine else c
        cf, rf = model(img.flip(3), refine=refine)
        hm_f = rf if refine else cf
        hm_f = torch.from_numpy(flip_back(hm_f.cpu().numpy(), FLIP_PAIRS).copy()).to(device)
        hm_f[..., 1:] = hm_f.clone()[..., :-1]
        heat = ((hm + hm_f) / 2).cpu().numpy()
        kp, mv = get_final_preds(heat, meta["center"].numpy(), meta["scale"].numpy())
        for n in range(len(kp)):
            ok = mv[n, :, 0] > 0.2
            rows.append({"index": int(meta["index"][n]), "image_id": int(meta["image_id"][n]), "category_id": 1,
                         "keypoints": np.concatenate([kp[n], mv[n]], 1).ravel().tolist(),
                         "score": float(mv[n, ok, 0].mean()) if ok.any() else 0.0})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() != 0:
        return 0.0
    uniq = {d.pop("index"): d for part in gathered for d in part}
    with open(path, "w") as f:
        json.dump(list(uniq.values()), f)
    E = COCOeval(ds.coco, ds.coco.loadRes(path), "keypoints")
    E.params.useSegm = None
    E.evaluate(); E.accumulate(); E.summarize()
    return float(E.stats[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/mnt/athletics")
    ap.add_argument("--out", default="/mnt/athletics/exp/w32_refine")
    ap.add_argument("--epochs", type=int, default=160)
    ap.add_argument("--refine-start", type=int, default=40)
    ap.add_argument("--refine-weight", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    kw = dict(image_size=[192, 256], sigma=2, flip_pairs=FLIP_PAIRS)
    train_ds = TopDownCocoDataset(args.data, "annotations/train.json", "frames", train=True, **kw)
    val_ds = TopDownCocoDataset(args.data, "annotations/val.json", "frames", train=False, **kw)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=args.workers, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, 64, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=args.workers,
                        pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(HRNetRefine()).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [120, 145], 0.1)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        use_refine = epoch >= args.refine_start
        model.train()
        t0 = time.time()
        meter = torch.zeros(3, device=device)
        for it, (img, target, weight, _) in enumerate(train_dl):
            img = img.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            weight = weight.to(device, non_blocking=True)
            coarse, refined = model(img, refine=use_refine)
            loss_c = weighted_mse(coarse, target, weight)
            loss_r = weighted_mse(refined, target, weight) if use_refine else torch.zeros((), device=device)
            loss = loss_c + args.refine_weight * loss_r
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            meter += torch.stack([loss_c.detach(), loss_r.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(meter)
        if rank == 0:
            print(f"epoch {epoch} coarse {(meter[0] / meter[2]).item():.6f} refine {(meter[1] / meter[2]).item():.6f} "
                  f"({time.time() - t0:.0f}s)", flush=True)

        if (epoch + 1) % 10 == 0:
            ap_val = evaluate(model, val_dl, val_ds, device, os.path.join(args.out, "val.json"), use_refine)
            if rank == 0:
                print(f"epoch {epoch} AP {ap_val:.4f} (refine={use_refine})", flush=True)
                if ap_val > best:
                    best = ap_val
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        if rank == 0:
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "best": best}, os.path.join(args.out, "latest.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
