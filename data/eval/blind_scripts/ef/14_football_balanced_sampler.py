"""HRNet-W32 on the football pose set with action-balanced sampling.

Most labelled players are running/standing; dives, slide tackles, bicycle
kicks and headers are rare but are what the analysts care about, so training
instances are drawn with weights inversely proportional to their action
frequency (annotation field "action" written by the labelling tool).

    torchrun --nproc_per_node=4 football_balanced_sampler.py --root /mnt/football --out /mnt/football/runs/w32_bal
"""
import argparse
import json
import os
import random
import time
from collections import Counter

import cv2
import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, WeightedRandomSampler
from torch.utils.data.distributed import DistributedSampler

from sportpose.targets import generate_gaussian_target
from sportpose.transforms import affine_transform, flip_back, fliplr_joints, get_affine_transform, get_final_preds

FLIP_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


class FootballPose(Dataset):
    def __init__(self, ann_file, img_dir, train, image_size=(192, 256)):
        self.coco = COCO(ann_file)
        self.img_dir = img_dir
        self.train = train
        self.image_size = np.array(image_size)
        self.items = []
        ar = image_size[0] / image_size[1]
        for ann in self.coco.loadAnns(self.coco.getAnnIds(iscrowd=False)):
            if ann.get("num_keypoints", 0) == 0:
                continue
            x, y, w, h = ann["bbox"]
            c = np.array([x + w / 2, y + h / 2], np.float32)
            w, h = (w, w / ar) if w > ar * h else (h * ar, h)
            kp = np.array(ann["keypoints"], np.float32).reshape(17, 3)
            self.items.append(dict(file=self.coco.imgs[ann["image_id"]]["file_name"], image_id=ann["image_id"],
                                   center=c, scale=np.array([w, h], np.float32) / 200 * 1.25,
                                   joints=kp[:, :2], vis=(kp[:, 2] > 0).astype(np.float32),
                                   action=ann.get("action", "other")))

    def sample_weights(self):
        freq = Counter(it["action"] for it in self.items)
        return [1.0 / freq[it["action"]] for it in self.items]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        img = cv2.imread(os.path.join(self.img_dir, it["file"]))[:, :, ::-1]
        c, s, r = it["center"].copy(), it["scale"].copy(), 0.0
        joints, vis = it["joints"].copy(), it["vis"].copy()
        if self.train:
            s *= np.clip(np.random.randn() * 0.3 + 1, 0.7, 1.3)
            r = float(np.clip(np.random.randn() * 40, -80, 80)) if random.random() < 0.6 else 0.0
            if random.random() < 0.5:
                img = img[:, ::-1]
                joints, vis = fliplr_joints(joints, vis, img.shape[1], FLIP_PAIRS)
                c[0] = img.shape[1] - 1 - c[0]
        t = get_affine_transform(c, s, r, self.image_size)
        crop = cv2.warpAffine(np.ascontiguousarray(img), t, (int(self.image_size[0]), int(self.image_size[1])))
        for j in range(17):
            if vis[j]:
                joints[j] = affine_transform(joints[j], t)
        hm, tw = generate_gaussian_target(joints, vis, self.image_size, self.image_size // 4, 2.0)
        x = ((crop.astype(np.float32) / 255 - MEAN) / STD).transpose(2, 0, 1)
        meta = dict(center=it["center"], scale=it["scale"], image_id=it["image_id"], index=i)
        return torch.from_numpy(x), torch.from_numpy(hm), torch.from_numpy(tw)[:, None], meta


def build_model():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = timm.create_model("hrnet_w32", pretrained=True, features_only=True,
                                              feature_location="", out_indices=(1,))
            self.final_layer = nn.Conv2d(self.backbone.feature_info.channels()[0], 17, 1)

        def forward(self, x):
            return self.final_layer(self.backbone(x)[0])
    return Net()


@torch.no_grad()
def evaluate(model, loader, coco, device, out_file):
    model.eval()
    mine = []
    for x, _, _, meta in loader:
        x = x.to(device, non_blocking=True)
        hm = model(x)
        hf = torch.from_numpy(flip_back(model(x.flip(3)).cpu().numpy(), FLIP_PAIRS).copy()).to(device)
        hf[..., 1:] = hf.clone()[..., :-1]
        heat = ((hm + hf) / 2).cpu().numpy()
        kp, mv = get_final_preds(heat, meta["center"].numpy(), meta["scale"].numpy())
        for n in range(len(kp)):
            v = mv[n, :, 0] > 0.2
            mine.append({"index": int(meta["index"][n]), "image_id": int(meta["image_id"][n]), "category_id": 1,
                         "keypoints": np.hstack([kp[n], mv[n]]).ravel().tolist(),
                         "score": float(mv[n, v, 0].mean()) if v.any() else 0.0})
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    if dist.get_rank() != 0:
        return 0.0
    uniq = {d.pop("index"): d for p in parts for d in p}
    with open(out_file, "w") as f:
        json.dump(list(uniq.values()), f)
    E = COCOeval(coco, coco.loadRes(out_file), "keypoints")
    E.params.useSegm = None
    E.evaluate(); E.accumulate(); E.summarize()
    return float(E.stats[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/mnt/football")
    ap.add_argument("--out", default="/mnt/football/runs/w32_bal")
    ap.add_argument("--epochs", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    train_ds = FootballPose(os.path.join(args.root, "annotations/train.json"), os.path.join(args.root, "frames"), True)
    val_ds = FootballPose(os.path.join(args.root, "annotations/val.json"), os.path.join(args.root, "frames"), False)
    balanced = WeightedRandomSampler(train_ds.sample_weights(), num_samples=len(train_ds), replacement=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=balanced, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=64, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=args.workers, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(build_model()).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [110, 135], 0.1)

    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        for x, y, w, _ in train_dl:
            x, y, w = x.to(device, non_blocking=True), y.to(device, non_blocking=True), w.to(device, non_blocking=True)
            out = model(x)
            b, k = out.shape[:2]
            loss = 0.5 * F.mse_loss(out.view(b, k, -1) * w, y.view(b, k, -1) * w)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            agg += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(agg)
        if rank == 0:
            print(f"epoch {epoch} loss {(agg[0] / agg[1]).item():.6f} {time.time() - t0:.0f}s", flush=True)
        if (epoch + 1) % 5 == 0:
            ap_val = evaluate(model, val_dl, val_ds.coco, device, os.path.join(args.out, "val_results.json"))
            if rank == 0:
                print(f"epoch {epoch} AP {ap_val:.4f}", flush=True)
                if ap_val > best:
                    best = ap_val
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        if rank == 0:
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "best": best}, os.path.join(args.out, "last.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
