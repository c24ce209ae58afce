"""TransPose-R-A4: ResNet stem + Transformer encoder + heatmap head, COCO 256x192.

Single machine, one process per GPU via torch.multiprocessing:

    python 20_transpose_r_spawn.py --data-dir data/coco --gpus 4
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from transpose_lib.dataset import COCOKeypointCrops
from transpose_lib.inference import get_final_preds, flip_back

FLIP_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]


class TransPoseR(nn.Module):
    def __init__(self, d_model=256, nhead=8, layers=4, ffn=1024, num_joints=17, feat_hw=(32, 24)):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V1")
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2)  # stride 8
        self.reduce = nn.Conv2d(512, d_model, 1, bias=False)
        self.pos = nn.Parameter(self._sine_pos(feat_hw, d_model), requires_grad=False)
        enc_layer = nn.TransformerEncoderLayer(d_model, nhead, ffn, dropout=0.1, activation="relu", batch_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, layers)
        self.deconv = nn.Sequential(nn.ConvTranspose2d(d_model, d_model, 4, 2, 1, bias=False),
                                    nn.BatchNorm2d(d_model), nn.ReLU(inplace=True))
        self.final = nn.Conv2d(d_model, num_joints, 1)
        self.hw = feat_hw

    @staticmethod
    def _sine_pos(hw, dim, temperature=10000):
        h, w = hw
        y = torch.arange(1, h + 1, dtype=torch.float32)[:, None].expand(h, w) / h * 2 * math.pi
        x = torch.arange(1, w + 1, dtype=torch.float32)[None, :].expand(h, w) / w * 2 * math.pi
        d = torch.arange(dim // 2, dtype=torch.float32)
        d = temperature ** (2 * (d // 2) / (dim // 2))
        px, py = x[..., None] / d, y[..., None] / d
        px = torch.stack([px[..., 0::2].sin(), px[..., 1::2].cos()], -1).flatten(2)
        py = torch.stack([py[..., 0::2].sin(), py[..., 1::2].cos()], -1).flatten(2)
        return torch.cat([py, px], -1).reshape(1, h * w, dim)

    def forward(self, x):
        f = self.reduce(self.stem(x))
        b, c, h, w = f.shape
        t = self.encoder(f.flatten(2).transpose(1, 2) + self.pos)
        f = t.transpose(1, 2).reshape(b, c, h, w)
        return self.final(self.deconv(f))


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="data/coco")
    p.add_argument("--out-dir", default="output/transpose_r_a4")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--batch-size", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=230)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


@torch.no_grad()
def validate(model, loader, coco, out_file, rank, world):
    model.eval()
    mine = []
    for img, _, _, meta in loader:
        img = img.cuda(non_blocking=True)
        out = model(img)
        out_f = torch.from_numpy(flip_back(model(img.flip(3)).cpu().numpy(), FLIP_PAIRS).copy()).cuda()
        out_f[:, :, :, 1:] = out_f.clone()[:, :, :, :-1]
        out = (out + out_f) / 2
        preds, maxvals = get_final_preds(out.cpu().numpy(), meta["center"].numpy(), meta["scale"].numpy())
        for i in range(len(preds)):
            s = maxvals[i][maxvals[i] > 0.2]
            mine.append({"idx": int(meta["idx"][i]), "image_id": int(meta["image_id"][i]), "category_id": 1,
                         "keypoints": np.concatenate([preds[i], maxvals[i]], 1).reshape(-1).tolist(),
                         "score": float(s.mean() if s.size else 0.0) * float(meta["score"][i])})
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    if rank != 0:
        return None
    results = list({r["idx"]: r for p in parts for r in p}.values())
    for r in results:
        r.pop("idx")
    json.dump(results, open(out_file, "w"))
    ev = COCOeval(coco, coco.loadRes(out_file), "keypoints")
    ev.params.useSegm = None
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return float(ev.stats[0])


def train_worker(gpu, args):
    world = args.gpus
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", rank=gpu, world_size=world)

    train_set = COCOKeypointCrops(args.data_dir, "train2017", (192, 256), train=True)
    val_set = COCOKeypointCrops(args.data_dir, "val2017", (192, 256), train=False)
    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=gpu, shuffle=True)
    val_sampler = DistributedSampler(val_set, num_replicas=world, rank=gpu, shuffle=False)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, 64, sampler=val_sampler, num_workers=args.workers, pin_memory=True)
    coco_val = COCO(os.path.join(args.data_dir, "annotations/person_keypoints_val2017.json")) if gpu == 0 else None

    model = nn.SyncBatchNorm.convert_sync_batchnorm(TransPoseR()).cuda(gpu)
    model = DDP(model, device_ids=[gpu])
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs, eta_min=1e-5)

    if gpu == 0:
        os.makedirs(args.out_dir, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (img, target, weight, _) in enumerate(train_loader):
            img = img.cuda(gpu, non_blocking=True)
            target = target.cuda(gpu, non_blocking=True)
            weight = weight.cuda(gpu, non_blocking=True)
            out = model(img)
            loss = 0.5 * F.mse_loss(out * weight[..., None], target * weight[..., None])
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if gpu == 0 and i % 100 == 0:
                print(f"[{epoch}/{args.epochs}][{i}/{len(train_loader)}] loss {loss.item():.6f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
        scheduler.step()

        if (epoch + 1) % 10 == 0:
            ap = validate(model, val_loader, coco_val, os.path.join(args.out_dir, f"res_{epoch}.json"), gpu, world)
            if gpu == 0:
                print(f"epoch {epoch}: AP {ap:.4f} ({time.time() - t0:.0f}s)", flush=True)
                if ap > best:
                    best = ap
                    torch.save(model.module.state_dict(), os.path.join(args.out_dir, "best.pth"))
        if gpu == 0:
            torch.save({"epoch": epoch + 1, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()}, os.path.join(args.out_dir, "checkpoint.pth"))
        dist.barrier()
    dist.destroy_process_group()


def main():
    args = parse_args()
    mp.spawn(train_worker, nprocs=args.gpus, args=(args))


if __name__ == "__main__":
    main()
