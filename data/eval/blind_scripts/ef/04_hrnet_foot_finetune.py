"""Fine-tune a COCO-pretrained HRNet-W32 to the 21-joint body+feet layout
(COCO 17 + left/right big toe + left/right heel) for the sprint-analysis project.

    torchrun --nproc_per_node=4 hrnet_foot_finetune.py \
        --coco-ckpt weights/hrnet_w32_coco_256x192.pth \
        --ann-dir /mnt/sprint/annotations --img-dir /mnt/sprint/frames --out /mnt/sprint/runs/ft21
"""
import argparse
import json
import logging
import os

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from sportpose.data import TopDownCocoDataset
from sportpose.transforms import affine_transform, get_affine_transform

NUM_JOINTS = 21
FLIP_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16], [17, 18], [19, 20]]
# COCO sigmas + foot sigmas (same values as the COCO-WholeBody feet)
SIGMAS = np.array([.26, .25, .25, .35, .35, .79, .79, .72, .72, .62, .62, 1.07, 1.07, .87, .87, .89, .89,
                   .68, .68, .66, .66]) / 10.0

log = logging.getLogger(__name__)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--coco-ckpt", required=True)
    p.add_argument("--ann-dir", required=True)
    p.add_argument("--img-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--head-lr-mult", type=float, default=10.0)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class HRNetKeypoints(nn.Module):
    def __init__(self, num_joints):
        super().__init__()
        self.backbone = timm.create_model("hrnet_w32", pretrained=False, features_only=True,
                                          feature_location="", out_indices=(1,))
        self.final_layer = nn.Conv2d(self.backbone.feature_info.channels()[0], num_joints, 1)

    def forward(self, x):
        return self.final_layer(self.backbone(x)[0])

    @torch.no_grad()
    def inference(self, x, flip_pairs, shift=True):
        """Flip-test: average the heatmaps of the image and of its mirror."""
        hm = self.forward(x)
        hm_f = self.forward(x.flip(3)).flip(3)
        perm = list(range(hm.shape[1]))
        for a, b in flip_pairs:
            perm[a], perm[b] = b, a
        hm_f = hm_f[:, perm]
        if shift:
            hm_f[..., 1:] = hm_f[..., :-1].clone()
        return 0.5 * (hm + hm_f)


def load_coco_weights(model, path):
    sd = torch.load(path, map_location="cpu")
    sd = sd.get("state_dict", sd)
    sd = {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}
    w, b = sd.pop("final_layer.weight"), sd.pop("final_layer.bias")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # copy the 17 body joints into the new head, feet start from scratch
    with torch.no_grad():
        model.final_layer.weight[:17].copy_(w)
        model.final_layer.bias[:17].copy_(b)
    return missing, unexpected


def decode(heat, center, scale):
    b, k, h, w = heat.shape
    flat = heat.reshape(b, k, -1)
    idx, conf = flat.argmax(-1), flat.max(-1)
    xy = np.stack([idx % w, idx // w], -1).astype(np.float32)
    out = np.zeros_like(xy)
    for n in range(b):
        for j in range(k):
            x, y = int(xy[n, j, 0]), int(xy[n, j, 1])
            if 0 < x < w - 1 and 0 < y < h - 1:
                xy[n, j, 0] += 0.25 * np.sign(heat[n, j, y, x + 1] - heat[n, j, y, x - 1])
                xy[n, j, 1] += 0.25 * np.sign(heat[n, j, y + 1, x] - heat[n, j, y - 1, x])
        inv = get_affine_transform(center[n], scale[n], 0, [w, h], inv=1)
        for j in range(k):
            out[n, j] = affine_transform(xy[n, j], inv)
    return out, conf


def evaluate(model, loader, coco_gt, device, out_dir):
    model.eval()
    dets = []
    for images, _, _, meta in loader:
        heat = model.inference(images.to(device, non_blocking=True), FLIP_PAIRS).cpu().numpy()
        coords, conf = decode(heat, meta["center"].numpy(), meta["scale"].numpy())
        for n in range(len(coords)):
            good = conf[n] > 0.2
            dets.append({"index": int(meta["index"][n]), "image_id": int(meta["image_id"][n]), "category_id": 1,
                         "keypoints": np.concatenate([coords[n], conf[n][:, None]], 1).ravel().tolist(),
                         "score": float(conf[n][good].mean()) if good.any() else 0.0})
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, dets)
    if dist.get_rank() != 0:
        return None
    dedup = {d["index"]: d for p in parts for d in p}
    res_path = os.path.join(out_dir, "val_dets.json")
    with open(res_path, "w") as f:
        json.dump([{k: v for k, v in d.items() if k != "index"} for d in dedup.values()], f)
    ev = COCOeval(coco_gt, coco_gt.loadRes(res_path), "keypoints")
    ev.params.kpt_oks_sigmas = SIGMAS
    ev.params.useSegm = None
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return ev.stats[0]


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s %(message)s")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    kw = dict(image_size=[192, 256], sigma=2, flip_pairs=FLIP_PAIRS, num_joints=NUM_JOINTS)
    train_ds = TopDownCocoDataset(None, os.path.join(args.ann_dir, "train.json"), args.img_dir, train=True, **kw)
    val_ds = TopDownCocoDataset(None, os.path.join(args.ann_dir, "val.json"), args.img_dir, train=False, **kw)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=64, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=args.workers, pin_memory=True)

    model = HRNetKeypoints(NUM_JOINTS)
    missing, unexpected = load_coco_weights(model, args.coco_ckpt)
    log.info("loaded COCO weights, missing=%d unexpected=%d", len(missing), len(unexpected))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    head_params = list(model.module.final_layer.parameters())
    head_ids = {id(p) for p in head_params}
    body_params = [p for p in model.parameters() if id(p) not in head_ids]
    optimizer = torch.optim.Adam([{"params": body_params, "lr": args.lr},
                                  {"params": head_params, "lr": args.lr * args.head_lr_mult}])
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_dl))

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        total = torch.zeros(2, device=device)
        for step, (images, target, weight, _) in enumerate(train_dl):
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            weight = weight.to(device, non_blocking=True)
            out = model(images)
            b, k = out.shape[:2]
            loss = 0.5 * F.mse_loss(out.reshape(b, k, -1) * weight, target.reshape(b, k, -1) * weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            total += torch.stack([loss.detach() * b, torch.tensor(float(b), device=device)])
            if step % 50 == 0:
                log.info("ep %d it %d/%d loss %.6f", epoch, step, len(train_dl), loss.item())
        dist.all_reduce(total)
        log.info("ep %d mean loss %.6f", epoch, (total[0] / total[1]).item())

        if (epoch + 1) % 5 == 0 or epoch == args.epochs - 1:
            ap = evaluate(model, val_dl, val_ds.coco, device, args.out)
            if rank == 0:
                log.info("ep %d AP %.4f (best %.4f)", epoch, ap, max(ap, best))
                if ap > best:
                    best = ap
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best_21kp.pth"))
        if rank == 0:
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()}, os.path.join(args.out, "last.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
