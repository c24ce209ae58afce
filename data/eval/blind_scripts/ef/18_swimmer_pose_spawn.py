"""Swimmer pose (underwater + above-water cameras), SimpleBaseline ResNet-50.

Underwater frames are low contrast, so we add CLAHE + colour jitter in the
dataset and train at 256x256 (swimmers are often horizontal).
Started from the pool-side workstation with plain python, one process per GPU.

    python swimmer_pose_spawn.py --data /data/swim --out /data/swim/exp/sb50_256 --world-size 2
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from sportpose.data import TopDownCocoDataset
from sportpose.transforms import flip_back, get_final_preds
from sportpose.augment import UnderwaterAug

FLIP_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/swim")
    p.add_argument("--out", default="/data/swim/exp/sb50_256")
    p.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    p.add_argument("--dist-url", default="tcp://127.0.0.1:23456")
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class SimpleBaseline(nn.Module):
    def __init__(self, num_joints=17):
        super().__init__()
        r50 = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        self.backbone = nn.Sequential(*list(r50.children())[:-2])
        blocks, cin = [], 2048
        for _ in range(3):
            blocks += [nn.ConvTranspose2d(cin, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True)]
            cin = 256
        self.deconv = nn.Sequential(*blocks)
        self.final_layer = nn.Conv2d(256, num_joints, 1)

    def forward(self, x):
        return self.final_layer(self.deconv(self.backbone(x)))


@torch.no_grad()
def evaluate(model, loader, ds, gpu, out_dir):
    model.eval()
    res = []
    for img, _, _, meta in loader:
        img = img.cuda(gpu, non_blocking=True)
        hm = model(img)
        hm_f = torch.from_numpy(flip_back(model(img.flip(3)).cpu().numpy(), FLIP_PAIRS).copy()).cuda(gpu)
        hm_f[..., 1:] = hm_f.clone()[..., :-1]
        heat = (0.5 * (hm + hm_f)).cpu().numpy()
        kp, mv = get_final_preds(heat, meta["center"].numpy(), meta["scale"].numpy())
        for n in range(len(kp)):
            ok = mv[n, :, 0] > 0.2
            res.append({"index": int(meta["index"][n]), "image_id": int(meta["image_id"][n]), "category_id": 1,
                        "keypoints": np.concatenate([kp[n], mv[n]], 1).ravel().tolist(),
                        "score": float(mv[n, ok, 0].mean()) if ok.any() else 0.0})
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, res)
    if dist.get_rank() != 0:
        return 0.0
    uniq = {r.pop("index"): r for p in parts for r in p}
    path = os.path.join(out_dir, "val_results.json")
    with open(path, "w") as f:
        json.dump(list(uniq.values()), f)
    E = COCOeval(ds.coco, ds.coco.loadRes(path), "keypoints")
    E.params.useSegm = None
    E.evaluate(); E.accumulate(); E.summarize()
    return float(E.stats[0])


def main_worker(gpu, args):
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=args.dist_url, world_size=args.world_size, rank=gpu)
    torch.backends.cudnn.benchmark = True

    aug = UnderwaterAug(clahe_p=0.5, jitter=0.3)
    kw = dict(image_size=[256, 256], sigma=2, flip_pairs=FLIP_PAIRS)
    train_ds = TopDownCocoDataset(args.data, "annotations/train.json", "frames", train=True, extra_aug=aug, **kw)
    val_ds = TopDownCocoDataset(args.data, "annotations/val.json", "frames", train=False, **kw)
    train_sampler = DistributedSampler(train_ds, num_replicas=args.world_size, rank=gpu, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, 64, num_workers=args.workers, pin_memory=True,
                        sampler=DistributedSampler(val_ds, num_replicas=args.world_size, rank=gpu, shuffle=False))

    model = nn.SyncBatchNorm.convert_sync_batchnorm(SimpleBaseline()).cuda(gpu)
    model = DDP(model, device_ids=[gpu])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [80, 105], 0.1)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        m = torch.zeros(2, device=f"cuda:{gpu}")
        for i, (img, target, weight, _) in enumerate(train_dl):
            img = img.cuda(gpu, non_blocking=True)
            target = target.cuda(gpu, non_blocking=True)
            weight = weight.cuda(gpu, non_blocking=True)
            out = model(img)
            b, k = out.shape[:2]
            loss = 0.5 * F.mse_loss(out.view(b, k, -1) * weight, target.view(b, k, -1) * weight)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            m += torch.stack([loss.detach(), torch.ones((), device=m.device)])
            if gpu == 0 and i % 100 == 0:
                print(f"[{epoch}][{i}/{len(train_dl)}] loss {loss.item():.6f}", flush=True)
        scheduler.step()
        dist.all_reduce(m)
        if gpu == 0:
            print(f"epoch {epoch}: {(m[0] / m[1]).item():.6f} in {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % 5 == 0:
            ap = evaluate(model, val_dl, val_ds, gpu, args.out)
            if gpu == 0:
                print(f"epoch {epoch}: AP {ap:.4f}", flush=True)
                if ap > best:
                    best = ap
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        if gpu == 0:
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()}, os.path.join(args.out, "latest.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    os.makedirs(args.out, exist_ok=True)
    mp.spawn(main_worker, nprocs=args.world_size, args=(args))
