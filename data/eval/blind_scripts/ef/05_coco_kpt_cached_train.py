"""Top-down pose trainer with a cached ground-truth database.

Building the gt db from person_keypoints_train2017.json + our 3 match datasets
takes ~6 minutes, so the parsed records are pickled next to the annotations and
reused by later runs.

    torchrun --nproc_per_node=8 coco_kpt_cached_train.py --ann /mnt/pose/ann/merged_train.json \
        --val-ann /mnt/pose/ann/merged_val.json --img-root /mnt/pose/images --out /mnt/pose/exp/r101
"""
import argparse
import hashlib
import json
import os
import pickle
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from sportpose.targets import generate_gaussian_target
from sportpose.transforms import affine_transform, fliplr_joints, get_affine_transform, get_final_preds

FLIP_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]
PIXEL_MEAN = np.array([123.675, 116.28, 103.53], dtype=np.float32)
PIXEL_STD = np.array([58.395, 57.12, 57.375], dtype=np.float32)


def args_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--ann", required=True)
    p.add_argument("--val-ann", required=True)
    p.add_argument("--img-root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=140)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=8)
    return p


class CachedTopDown(Dataset):
    def __init__(self, ann_file, img_root, train, image_size=(192, 256), sigma=2.0):
        self.ann_file = ann_file
        self.img_root = img_root
        self.train = train
        self.image_size = np.array(image_size)
        self.sigma = sigma
        self.db = self._get_db()

    def _cache_path(self):
        key = hashlib.md5(f"{os.path.abspath(self.ann_file)}:{os.path.getmtime(self.ann_file)}".encode()).hexdigest()[:10]
        return os.path.join(os.path.dirname(self.ann_file), f".gt_db_{key}.pkl")

    def _get_db(self):
        cache = self._cache_path()
        if os.path.exists(cache):
            with open(cache, "rb") as f:
                return pickle.load(f)
        db = self._parse(COCO(self.ann_file))
        with open(cache, "wb") as f:
            pickle.dump(db, f, protocol=pickle.HIGHEST_PROTOCOL)
        return db

    def _parse(self, coco):
        db = []
        aspect = self.image_size[0] / self.image_size[1]
        for img_id in coco.getImgIds():
            info = coco.loadImgs(img_id)[0]
            for ann in coco.loadAnns(coco.getAnnIds(imgIds=img_id, iscrowd=False)):
                x, y, w, h = ann["bbox"]
                if max(ann["keypoints"][2::3]) == 0 or w < 2 or h < 2:
                    continue
                c = np.array([x + w / 2, y + h / 2], np.float32)
                w, h = (w, w / aspect) if w > aspect * h else (h * aspect, h)
                kp = np.asarray(ann["keypoints"], np.float32).reshape(-1, 3)
                db.append({"file": os.path.join(self.img_root, info["file_name"]), "center": c,
                           "scale": np.array([w, h], np.float32) / 200.0 * 1.25, "joints": kp[:, :2],
                           "vis": (kp[:, 2] > 0).astype(np.float32), "image_id": img_id})
        return db

    def __len__(self):
        return len(self.db)

    def __getitem__(self, i):
        r = self.db[i]
        img = cv2.imread(r["file"], cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)[..., ::-1]
        c, s, rot = r["center"].copy(), r["scale"].copy(), 0.0
        joints, vis = r["joints"].copy(), r["vis"].copy()
        if self.train:
            s *= np.clip(np.random.randn() * 0.25 + 1, 0.75, 1.25)
            rot = float(np.clip(np.random.randn() * 30, -60, 60)) if np.random.rand() < 0.6 else 0.0
            if np.random.rand() < 0.5:
                img = img[:, ::-1]
                joints, vis = fliplr_joints(joints, vis, img.shape[1], FLIP_PAIRS)
                c[0] = img.shape[1] - c[0] - 1
        t = get_affine_transform(c, s, rot, self.image_size)
        crop = cv2.warpAffine(np.ascontiguousarray(img), t, tuple(int(v) for v in self.image_size))
        for j in np.nonzero(vis)[0]:
            joints[j] = affine_transform(joints[j], t)
        target, tw = generate_gaussian_target(joints, vis, self.image_size, self.image_size // 4, self.sigma)
        x = ((crop.astype(np.float32) - PIXEL_MEAN) / PIXEL_STD).transpose(2, 0, 1)
        meta = {"center": r["center"], "scale": r["scale"], "image_id": r["image_id"], "index": i}
        return torch.from_numpy(x), torch.from_numpy(target), torch.from_numpy(tw).view(-1, 1), meta


def build_model(num_joints=17):
    r = torchvision.models.resnet101(weights="IMAGENET1K_V2")
    deconv = []
    cin = 2048
    for _ in range(3):
        deconv += [nn.ConvTranspose2d(cin, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True)]
        cin = 256
    return nn.Sequential(*list(r.children())[:-2], *deconv, nn.Conv2d(256, num_joints, 1))


@torch.no_grad()
def run_eval(model, loader, coco, device, out):
    model.eval()
    res = []
    for x, _, _, meta in loader:
        x = x.to(device, non_blocking=True)
        hm = model(x)
        hm_f = model(x.flip(3)).flip(3)
        hm_f = hm_f[:, [0, 2, 1, 4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 13, 16, 15]]
        hm_f[..., 1:] = hm_f[..., :-1].clone()
        heat = (0.5 * (hm + hm_f)).cpu().numpy()
        preds, maxv = get_final_preds(heat, meta["center"].numpy(), meta["scale"].numpy())
        for n in range(len(preds)):
            m = maxv[n, :, 0] > 0.2
            res.append(dict(index=int(meta["index"][n]), image_id=int(meta["image_id"][n]), category_id=1,
                            keypoints=np.hstack([preds[n], maxv[n]]).ravel().tolist(),
                            score=float(maxv[n, m, 0].mean()) if m.any() else 0.0))
    allres = [None] * dist.get_world_size()
    dist.all_gather_object(allres, res)
    if dist.get_rank() != 0:
        return -1.0
    uniq = {d.pop("index"): d for chunk in allres for d in chunk}
    path = os.path.join(out, "val_results.json")
    with open(path, "w") as f:
        json.dump(list(uniq.values()), f)
    E = COCOeval(coco, coco.loadRes(path), "keypoints")
    E.params.useSegm = None
    E.evaluate(); E.accumulate(); E.summarize()
    return float(E.stats[0])


def main():
    args = args_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    t0 = time.time()
    train_ds = CachedTopDown(args.ann, args.img_root, train=True)
    val_ds = CachedTopDown(args.val_ann, args.img_root, train=False)
    val_coco = COCO(args.val_ann) if rank == 0 else None
    if rank == 0:
        print(f"db ready: {len(train_ds)} train / {len(val_ds)} val instances in {time.time() - t0:.0f}s", flush=True)

    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=64, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=args.workers, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(build_model()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [90, 120], 0.1)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        agg = torch.zeros(2, device=device)
        for x, y, w, _ in train_dl:
            x, y, w = x.to(device, non_blocking=True), y.to(device, non_blocking=True), w.to(device, non_blocking=True)
            out = model(x)
            n, k = out.shape[:2]
            loss = 0.5 * ((out.view(n, k, -1) - y.view(n, k, -1)) ** 2 * w).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            agg += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(agg)
        if rank == 0:
            print(f"epoch {epoch}: loss {(agg[0] / agg[1]).item():.6f}", flush=True)
        if (epoch + 1) % 10 == 0:
            ap = run_eval(model, val_dl, val_coco, device, args.out)
            if rank == 0:
                print(f"epoch {epoch}: AP {ap:.4f}", flush=True)
                if ap > best:
                    best = ap
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        if rank == 0:
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict()},
                       os.path.join(args.out, "latest.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
