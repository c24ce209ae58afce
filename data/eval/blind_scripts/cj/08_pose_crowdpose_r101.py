"""Top-down ResNet-101 + deconv pose model on CrowdPose (14 joints), OKS AP evaluation.

torchrun --nproc_per_node=8 08_pose_crowdpose_r101.py --root /data/crowdpose --out work/crowdpose_r101
"""
import argparse
import json
import os
import pickle

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CROWDPOSE_SIGMAS = np.array([.79, .79, .72, .72, .62, .62, 1.07, 1.07, .87, .87, .89, .89, .79, .79]) / 10.0
FLIP_PAIRS = [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11)]
IN_W, IN_H = 192, 256


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/crowdpose")
    ap.add_argument("--out", default="work/crowdpose_r101")
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU")
    ap.add_argument("--base-lr", type=float, default=5e-4, help="for a global batch of 256")
    ap.add_argument("--epochs", type=int, default=210)
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--resume", default="")
    return ap.parse_args()


def build_db(ann_file):
    coco = COCO(ann_file)
    db = []
    for ann in coco.loadAnns(coco.getAnnIds(iscrowd=False)):
        if ann["num_keypoints"] == 0:
            continue
        info = coco.loadImgs(ann["image_id"])[0]
        db.append({"file": info["file_name"], "image_id": ann["image_id"], "bbox": ann["bbox"],
                   "kpts": np.array(ann["keypoints"], np.float32).reshape(-1, 3)})
    return db


def load_db_cached(ann_file, cache_file, rank):
    # one process parses the json and writes the cache; the others wait and read it
    if rank == 0 and not os.path.exists(cache_file):
        db = build_db(ann_file)
        tmp = cache_file + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump(db, f)
        os.replace(tmp, cache_file)
    dist.barrier()
    with open(cache_file, "rb") as f:
        return pickle.load(f)


class TopDown(Dataset):
    def __init__(self, db, img_dir, train):
        self.db, self.img_dir, self.train = db, img_dir, train

    def __len__(self):
        return len(self.db)

    def __getitem__(self, i):
        rec = self.db[i]
        img = cv2.cvtColor(cv2.imread(os.path.join(self.img_dir, rec["file"])), cv2.COLOR_BGR2RGB)
        x, y, w, h = rec["bbox"]
        c = np.array([x + w / 2, y + h / 2], np.float32)
        s = max(w, h * IN_W / IN_H) * 1.25
        kpts = rec["kpts"].copy()
        rot = 0.0
        if self.train:
            s *= np.clip(1 + 0.3 * np.random.randn(), 0.7, 1.3)
            rot = float(np.clip(30 * np.random.randn(), -60, 60)) if np.random.rand() < 0.4 else 0.0
            if np.random.rand() < 0.5:
                img = img[:, ::-1]
                c[0] = img.shape[1] - 1 - c[0]
                kpts[:, 0] = img.shape[1] - 1 - kpts[:, 0]
                for a, b in FLIP_PAIRS:
                    kpts[[a, b]] = kpts[[b, a]]
        M = cv2.getRotationMatrix2D((float(c[0]), float(c[1])), rot, IN_W / s)
        M[:, 2] += np.array([IN_W / 2, IN_H / 2]) - c
        patch = cv2.warpAffine(np.ascontiguousarray(img), M, (IN_W, IN_H))
        hm_xy = (np.c_[kpts[:, :2], np.ones(len(kpts))] @ M.T) / 4.0
        gx, gy = np.arange(IN_W // 4), np.arange(IN_H // 4)[:, None]
        target = np.zeros((14, IN_H // 4, IN_W // 4), np.float32)
        weight = np.zeros((14, 1), np.float32)
        for j in range(14):
            if kpts[j, 2] > 0 and 0 <= hm_xy[j, 0] < IN_W // 4 and 0 <= hm_xy[j, 1] < IN_H // 4:
                target[j] = np.exp(-((gx - hm_xy[j, 0]) ** 2 + (gy - hm_xy[j, 1]) ** 2) / 8.0)
                weight[j] = 1
        patch = (patch / 255.0 - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]
        meta = np.array([c[0], c[1], s, rec["image_id"], i], np.float64)
        return torch.from_numpy(patch.transpose(2, 0, 1).astype(np.float32)), torch.from_numpy(target), \
            torch.from_numpy(weight), torch.from_numpy(meta)


class PoseNet(nn.Module):
    def __init__(self, num_joints=14, grad_ckpt=False):
        super().__init__()
        r = torchvision.models.resnet101(weights="IMAGENET1K_V2")
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.stages = nn.ModuleList([r.layer1, r.layer2, r.layer3, r.layer4])
        deconv, ch = [], 2048
        for _ in range(3):
            deconv += [nn.ConvTranspose2d(ch, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(inplace=True)]
            ch = 256
        self.deconv = nn.Sequential(*deconv)
        self.final = nn.Conv2d(256, num_joints, 1)
        self.grad_ckpt = grad_ckpt

    def forward(self, x):
        x = self.stem(x)
        for stage in self.stages:
            x = checkpoint(stage, x, use_reentrant=False) if self.grad_ckpt and self.training else stage(x)
        return self.final(self.deconv(x))


@torch.no_grad()
def run_eval(model, loader, gt_file, out_dir, device):
    model.eval()
    dets = []
    for img, _, _, meta in loader:
        img = img.to(device, non_blocking=True)
        hm = model(img)
        flipped = model(img.flip(3)).flip(3)
        for a, b in FLIP_PAIRS:
            flipped[:, [a, b]] = flipped[:, [b, a]]
        hm = ((hm + flipped) / 2).float()
        n, j, h, w = hm.shape
        conf, idx = hm.view(n, j, -1).max(2)
        xy = torch.stack([idx % w, idx // w], 2).float().cpu().numpy() * 4
        conf, meta = conf.cpu().numpy(), meta.numpy()
        for k in range(n):
            cx, cy, s, image_id, index = meta[k]
            pts = (xy[k] - [IN_W / 2, IN_H / 2]) * (s / IN_W) + [cx, cy]
            dets.append({"index": int(index), "image_id": int(image_id), "category_id": 1,
                         "keypoints": np.c_[pts, conf[k]].reshape(-1).tolist(), "score": float(conf[k].mean())})
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, dets)
    result = [0.0]
    if dist.get_rank() == 0:
        # DistributedSampler pads the last shard with repeated samples: keep one prediction per index
        uniq = {d["index"]: d for p in parts for d in p}
        res_file = os.path.join(out_dir, "val_results.json")
        with open(res_file, "w") as f:
            json.dump([{k: v for k, v in d.items() if k != "index"} for d in uniq.values()], f)
        gt = COCO(gt_file)
        ev = COCOeval(gt, gt.loadRes(res_file), "keypoints")
        ev.params.kpt_oks_sigmas = CROWDPOSE_SIGMAS
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
        result = [float(ev.stats[0])]
    dist.broadcast_object_list(result, src=0)
    return result[0]


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    os.makedirs(args.out, exist_ok=True)

    train_file = os.path.join(args.root, "json", "crowdpose_trainval.json")
    val_file = os.path.join(args.root, "json", "crowdpose_test.json")
    train_db = load_db_cached(train_file, os.path.join(args.out, "trainval_db.pkl"), rank)
    val_db = load_db_cached(val_file, os.path.join(args.out, "test_db.pkl"), rank)
    img_dir = os.path.join(args.root, "images")
    train_set, val_set = TopDown(train_db, img_dir, True), TopDown(val_db, img_dir, False)

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, 64, sampler=DistributedSampler(val_set, shuffle=False), num_workers=8)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(PoseNet(grad_ckpt=args.grad_ckpt)).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.base_lr * args.batch_size * world / 256
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [170, 200], 0.1)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best_ap = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_ap = ckpt["epoch"], ckpt.get("best_ap", 0.0)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        total = torch.zeros(2, device=device)
        for img, target, weight, _ in train_loader:
            img, target, weight = img.to(device), target.to(device), weight.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                pred = model(img)
            loss = 0.5 * (((pred.float() - target) ** 2) * weight[..., None]).mean()
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            total += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch + 1}: train loss {(total[0] / total[1]).item():.6f}", flush=True)

        if (epoch + 1) % 10 == 0 or epoch + 1 == args.epochs:
            ap = run_eval(model, val_loader, val_file, args.out, device)
            if rank == 0:
                print(f"epoch {epoch + 1}: CrowdPose AP {ap:.4f}", flush=True)
            best_ap = max(best_ap, ap)
            if rank == 0:
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                         "epoch": epoch + 1, "best_ap": best_ap}
                torch.save(state, os.path.join(args.out, "latest.pth"))
                if ap >= best_ap:
                    torch.save(state, os.path.join(args.out, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
