"""HRNet-W32 top-down keypoints with a cached person database and weight EMA.

Parsing person_keypoints_train2017.json into the per-person records takes a few
minutes, so the records are pickled under <data_root>/cache and reused.

    torchrun --nproc_per_node=8 07_hrnet_cached_gtdb.py --data-root /datasets/coco --epochs 210
"""
import argparse
import copy
import math
import os
import pickle
import time
from dataclasses import dataclass

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from pycocotools.coco import COCO
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from models.pose_hrnet import PoseHighResolutionNet
from utils.heatmap import encode_gaussian, decode_with_dark
from utils.transforms import get_affine_transform, transform_points, flip_pairs_coco, flip_joints, FLIP_INDEX
from utils.coco_eval import evaluate_keypoints


@dataclass
class Config:
    data_root: str = "/datasets/coco"
    out_dir: str = "runs/hrnet_w32_ema"
    input_w: int = 192
    input_h: int = 256
    sigma: float = 2.0
    batch_per_gpu: int = 32
    lr: float = 1e-3
    epochs: int = 210
    lr_steps: tuple = (170, 200)
    ema_decay: float = 0.9998
    workers: int = 8


def build_records(coco, img_dir, aspect):
    recs = []
    for img_id in sorted(coco.getImgIds()):
        info = coco.loadImgs(img_id)[0]
        for ann in coco.loadAnns(coco.getAnnIds(imgIds=img_id, iscrowd=False)):
            if ann["num_keypoints"] == 0 or ann["area"] <= 0:
                continue
            x, y, w, h = ann["bbox"]
            x1, y1 = max(0, x), max(0, y)
            x2, y2 = min(info["width"] - 1, x1 + max(0, w - 1)), min(info["height"] - 1, y1 + max(0, h - 1))
            if x2 <= x1 or y2 <= y1:
                continue
            w, h = x2 - x1, y2 - y1
            if w > aspect * h:
                h = w / aspect
            else:
                w = h * aspect
            kps = np.asarray(ann["keypoints"], np.float32).reshape(17, 3)
            recs.append(dict(path=os.path.join(img_dir, info["file_name"]), image_id=img_id,
                             center=np.array([x1 + (x2 - x1) / 2, y1 + (y2 - y1) / 2], np.float32),
                             scale=np.array([w, h], np.float32) * 1.25 / 200.0, kpts=kps))
    return recs


def load_records(data_root, split, aspect):
    cache_dir = os.path.join(data_root, "cache")
    cache_file = os.path.join(cache_dir, f"{split}_person_records.pkl")
    if os.path.exists(cache_file):
        with open(cache_file, "rb") as f:
            return pickle.load(f)
    coco = COCO(os.path.join(data_root, "annotations", f"person_keypoints_{split}.json"))
    recs = build_records(coco, os.path.join(data_root, split), aspect)
    os.makedirs(cache_dir, exist_ok=True)
    with open(cache_file, "wb") as f:
        pickle.dump(recs, f, protocol=pickle.HIGHEST_PROTOCOL)
    return recs


class PersonCrops(Dataset):
    def __init__(self, records, cfg, train):
        self.recs, self.cfg, self.train = records, cfg, train
        self.mean = np.array([0.485, 0.456, 0.406], np.float32) * 255
        self.std = np.array([0.229, 0.224, 0.225], np.float32) * 255

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, idx):
        r = copy.deepcopy(self.recs[idx])
        img = cv2.imread(r["path"], cv2.IMREAD_COLOR)[:, :, ::-1]
        kpts, c, s, rot = r["kpts"], r["center"], r["scale"], 0.0
        if self.train:
            s *= np.clip(np.random.randn() * 0.35 + 1, 0.65, 1.35)
            if np.random.rand() < 0.6:
                rot = float(np.clip(np.random.randn() * 45, -90, 90))
            if np.random.rand() < 0.5:
                img = img[:, ::-1]
                kpts = flip_joints(kpts, img.shape[1], flip_pairs_coco)
                c[0] = img.shape[1] - 1 - c[0]
        size = (self.cfg.input_w, self.cfg.input_h)
        trans = get_affine_transform(c, s, rot, size)
        crop = cv2.warpAffine(np.ascontiguousarray(img), trans, size, flags=cv2.INTER_LINEAR)
        kpts[:, :2] = transform_points(kpts[:, :2], trans)
        hm, w = encode_gaussian(kpts, (self.cfg.input_w // 4, self.cfg.input_h // 4), stride=4, sigma=self.cfg.sigma)
        crop = ((crop - self.mean) / self.std).transpose(2, 0, 1).astype(np.float32)
        info = np.array([idx, r["image_id"], c[0], c[1], s[0], s[1]], np.float64)
        return torch.from_numpy(crop), torch.from_numpy(hm), torch.from_numpy(w), torch.from_numpy(info)


class ModelEMA:
    def __init__(self, model, decay):
        self.ema = copy.deepcopy(model).eval()
        self.decay = decay
        self.updates = 0
        for p in self.ema.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        self.updates += 1
        d = self.decay * (1 - math.exp(-self.updates / 2000))
        msd = model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(d).add_(msd[k].detach(), alpha=1 - d)


@torch.no_grad()
def predict_all(net, loader, device):
    net.eval()
    rows = []
    for img, _, _, info in loader:
        hm = net(img.to(device, non_blocking=True))
        hm_f = net(img.flip(3).to(device, non_blocking=True)).flip(3)[:, FLIP_INDEX]
        kp = decode_with_dark((hm + hm_f) / 2, info[:, 2:4].to(device), info[:, 4:6].to(device))
        rows.append(torch.cat([info[:, :2].to(device), kp.flatten(1)], 1))
    rows = torch.cat(rows) if rows else torch.zeros(0, 2 + 51, device=device)
    # pad to the largest shard so all_gather sees equal shapes
    n = torch.tensor([rows.shape[0]], device=device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    max_n = int(max(s.item() for s in sizes))
    padded = torch.zeros(max_n, rows.shape[1], device=device, dtype=rows.dtype)
    padded[: rows.shape[0]] = rows
    out = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(out, padded)
    return torch.cat([o[: int(s.item())] for o, s in zip(out, sizes)]).cpu().numpy()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default=Config.data_root)
    p.add_argument("--out-dir", default=Config.out_dir)
    p.add_argument("--epochs", type=int, default=Config.epochs)
    a = p.parse_args()
    cfg = Config(data_root=a.data_root, out_dir=a.out_dir, epochs=a.epochs)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    aspect = cfg.input_w / cfg.input_h
    train_set = PersonCrops(load_records(cfg.data_root, "train2017", aspect), cfg, train=True)
    val_set = PersonCrops(load_records(cfg.data_root, "val2017", aspect), cfg, train=False)
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, cfg.batch_per_gpu, sampler=sampler, num_workers=cfg.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, 64, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=cfg.workers, pin_memory=True)

    net = PoseHighResolutionNet(width=32, num_joints=17, pretrained="weights/hrnet_w32-36af842e.pth")
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    ema = ModelEMA(model.module, cfg.ema_decay)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, list(cfg.lr_steps), 0.1)
    mse = nn.MSELoss()

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for i, (img, hm, w, _) in enumerate(train_loader):
            img, hm, w = img.to(device, non_blocking=True), hm.to(device, non_blocking=True), w.to(device, non_blocking=True)
            out = model(img)
            loss = 0.5 * mse(out * w[..., None, None], hm * w[..., None, None])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            ema.update(model.module)
            if rank == 0 and i % 200 == 0:
                print(f"epoch {epoch} iter {i}/{len(train_loader)} loss {loss.item():.6f} {time.time() - tic:.0f}s",
                      flush=True)
        sched.step()

        if (epoch + 1) % 10 == 0:
            preds = predict_all(ema.ema, val_loader, device)
            if rank == 0:
                _, keep = np.unique(preds[:, 0], return_index=True)
                stats = evaluate_keypoints(os.path.join(cfg.data_root, "annotations/person_keypoints_val2017.json"),
                                           preds[keep], os.path.join(cfg.out_dir, f"val_{epoch + 1}.json"))
                print(f"epoch {epoch + 1}: AP {stats['AP']:.4f} AP50 {stats['AP50']:.4f}", flush=True)
        if rank == 0:
            torch.save({"epoch": epoch + 1, "model": model.module.state_dict(), "ema": ema.ema.state_dict(),
                        "opt": opt.state_dict(), "sched": sched.state_dict()},
                       os.path.join(cfg.out_dir, "last.pth"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
