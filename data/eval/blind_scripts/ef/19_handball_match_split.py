"""Handball keypoints: HRNet-W32 trained on our per-match label files.

Labels come as one json per match from the annotation tool:
    {"frames": [{"file": "...jpg", "players": [{"bbox": [x, y, w, h], "keypoints": [x, y, v] * 17}]}]}
We hold out whole matches for validation (frames of one match are highly
correlated, so a frame-level split would leak).

    torchrun --nproc_per_node=4 handball_match_split.py --labels /mnt/handball/labels --frames /mnt/handball/frames \
        --out /mnt/handball/exp/w32
"""
import argparse
import glob
import json
import os
import random
import time

import cv2
import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from sportpose.targets import generate_gaussian_target
from sportpose.transforms import affine_transform, flip_back, fliplr_joints, get_affine_transform, get_final_preds

FLIP_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]
SIGMAS = np.array([.26, .25, .25, .35, .35, .79, .79, .72, .72, .62, .62, 1.07, 1.07, .87, .87, .89, .89]) / 10.0
MEAN, STD = np.array([0.485, 0.456, 0.406], np.float32), np.array([0.229, 0.224, 0.225], np.float32)


def load_match(path, frame_root):
    with open(path) as f:
        data = json.load(f)
    match = os.path.splitext(os.path.basename(path))[0]
    recs = []
    for fr in data["frames"]:
        for pl in fr["players"]:
            kp = np.array(pl["keypoints"], np.float32).reshape(17, 3)
            if (kp[:, 2] > 0).sum() < 3:
                continue
            recs.append({"file": os.path.join(frame_root, match, fr["file"]), "bbox": np.array(pl["bbox"], np.float32),
                         "joints": kp[:, :2], "vis": (kp[:, 2] > 0).astype(np.float32)})
    return recs


class PlayerCrops(Dataset):
    def __init__(self, records, train, image_size=(192, 256)):
        self.recs = records
        self.train = train
        self.size = np.array(image_size)

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, i):
        r = self.recs[i]
        x, y, w, h = r["bbox"]
        ar = self.size[0] / self.size[1]
        c = np.array([x + w / 2, y + h / 2], np.float32)
        w, h = (w, w / ar) if w > ar * h else (h * ar, h)
        s = np.array([w, h], np.float32) / 200 * 1.25
        img = cv2.cvtColor(cv2.imread(r["file"]), cv2.COLOR_BGR2RGB)
        joints, vis, rot, cc, ss = r["joints"].copy(), r["vis"].copy(), 0.0, c.copy(), s.copy()
        if self.train:
            ss = ss * np.clip(np.random.randn() * 0.3 + 1, 0.7, 1.3)
            rot = float(np.clip(np.random.randn() * 30, -60, 60)) if random.random() < 0.5 else 0.0
            if random.random() < 0.5:
                img = img[:, ::-1]
                joints, vis = fliplr_joints(joints, vis, img.shape[1], FLIP_PAIRS)
                cc[0] = img.shape[1] - cc[0] - 1
        t = get_affine_transform(cc, ss, rot, self.size)
        crop = cv2.warpAffine(np.ascontiguousarray(img), t, (int(self.size[0]), int(self.size[1])))
        for j in range(17):
            if vis[j] > 0:
                joints[j] = affine_transform(joints[j], t)
        hm, tw = generate_gaussian_target(joints, vis, self.size, self.size // 4, 2.0)
        inp = ((crop.astype(np.float32) / 255 - MEAN) / STD).transpose(2, 0, 1)
        meta = {"center": c, "scale": s, "gt": np.concatenate([r["joints"], r["vis"][:, None]], 1),
                "area": np.float32(r["bbox"][2] * r["bbox"][3])}
        return torch.from_numpy(inp), torch.from_numpy(hm), torch.from_numpy(tw)[:, None], meta


class PoseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = timm.create_model("hrnet_w32", pretrained=True, features_only=True,
                                          feature_location="", out_indices=(1,))
        self.final_layer = nn.Conv2d(self.backbone.feature_info.channels()[0], 17, 1)

    def forward(self, x):
        return self.final_layer(self.backbone(x)[0])


def oks(pred, gt, area):
    vis = gt[:, 2] > 0
    if not vis.any():
        return None
    d2 = ((pred[:, :2] - gt[:, :2]) ** 2).sum(1)
    e = d2 / (2 * (area + np.spacing(1)) * (2 * SIGMAS) ** 2)
    return float(np.exp(-e)[vis].mean())


@torch.no_grad()
def evaluate(model, loader, device):
    """Mean OKS and OKS@0.5 / 0.75 hit-rates on GT boxes (fast proxy for AP)."""
    model.eval()
    acc = torch.zeros(4, device=device)
    for img, _, _, meta in loader:
        img = img.to(device, non_blocking=True)
        hm = model(img)
        hm_f = torch.from_numpy(flip_back(model(img.flip(3)).cpu().numpy(), FLIP_PAIRS).copy()).to(device)
        hm_f[..., 1:] = hm_f.clone()[..., :-1]
        kp, _ = get_final_preds(((hm + hm_f) / 2).cpu().numpy(), meta["center"].numpy(), meta["scale"].numpy())
        for n in range(len(kp)):
            o = oks(kp[n], meta["gt"][n].numpy(), float(meta["area"][n]))
            if o is not None:
                acc += torch.tensor([o, float(o > 0.5), float(o > 0.75), 1.0], device=device)
    dist.all_reduce(acc)
    n = acc[3].clamp(min=1)
    return (acc[0] / n).item(), (acc[1] / n).item(), (acc[2] / n).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--labels", default="/mnt/handball/labels")
    ap.add_argument("--frames", default="/mnt/handball/frames")
    ap.add_argument("--out", default="/mnt/handball/exp/w32")
    ap.add_argument("--val-frac", type=float, default=0.15)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    # different seed per rank so the ranks do not apply identical augmentations
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    match_files = sorted(glob.glob(os.path.join(args.labels, "*.json")))
    random.shuffle(match_files)
    n_val = max(1, int(len(match_files) * args.val_frac))
    val_files, train_files = match_files[:n_val], match_files[n_val:]
    train_recs = [r for p in train_files for r in load_match(p, args.frames)]
    val_recs = [r for p in val_files for r in load_match(p, args.frames)]
    if rank == 0:
        print(f"{len(train_files)} train matches ({len(train_recs)} players), "
              f"{len(val_files)} val matches ({len(val_recs)} players)", flush=True)
        with open(os.path.join(args.out, "split.json"), "w") as f:
            json.dump({"train": train_files, "val": val_files}, f, indent=1)

    train_ds, val_ds = PlayerCrops(train_recs, True), PlayerCrops(val_recs, False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=args.workers, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, 64, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=args.workers,
                        pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(PoseNet()).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs, eta_min=1e-6)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        for img, tgt, w, _ in train_dl:
            img, tgt, w = img.to(device, non_blocking=True), tgt.to(device, non_blocking=True), w.to(device, non_blocking=True)
            out = model(img)
            b, k = out.shape[:2]
            loss = 0.5 * F.mse_loss(out.view(b, k, -1) * w, tgt.view(b, k, -1) * w)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            agg += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(agg)
        if (epoch + 1) % 5 == 0:
            m_oks, oks50, oks75 = evaluate(model, val_dl, device)
            if rank == 0:
                print(f"epoch {epoch}: loss {(agg[0] / agg[1]).item():.6f} mOKS {m_oks:.4f} "
                      f"OKS>.5 {oks50:.3f} OKS>.75 {oks75:.3f} ({time.time() - t0:.0f}s)", flush=True)
                if m_oks > best:
                    best = m_oks
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        if rank == 0:
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "best": best}, os.path.join(args.out, "latest.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
