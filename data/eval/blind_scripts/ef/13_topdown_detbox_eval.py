"""Top-down HRNet trainer whose validation runs on detector boxes, not GT boxes.

Validation follows the usual COCO protocol: person boxes from our YOLO
detector (AP_H ~ 56), flip test, keypoint rescoring and OKS-NMS per image.
Val images are split by image id across ranks so OKS-NMS sees all the boxes of
an image on one rank.

    torchrun --nproc_per_node=8 topdown_detbox_eval.py --data /mnt/datasets/coco \
        --det-json /mnt/datasets/coco/person_detection_results/yolo_val2017_person.json --out /mnt/exp/w32_det
"""
import argparse
import json
import os
import time
from collections import defaultdict

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

from sportpose.data import DetBoxDataset, TopDownCocoDataset
from sportpose.nms import oks_nms
from sportpose.transforms import flip_back, get_final_preds

FLIP_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/mnt/datasets/coco")
    p.add_argument("--det-json", required=True)
    p.add_argument("--out", default="/mnt/exp/w32_det")
    p.add_argument("--epochs", type=int, default=210)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--det-thr", type=float, default=0.0)
    p.add_argument("--in-vis-thre", type=float, default=0.2)
    p.add_argument("--oks-thre", type=float, default=0.9)
    return p.parse_args()


class HRNetPose(nn.Module):
    def __init__(self, num_joints=17):
        super().__init__()
        self.backbone = timm.create_model("hrnet_w32", pretrained=True, features_only=True,
                                          feature_location="", out_indices=(1,))
        self.final_layer = nn.Conv2d(self.backbone.feature_info.channels()[0], num_joints, 1)

    def forward(self, x):
        return self.final_layer(self.backbone(x)[0])


def load_detections(path, thr):
    with open(path) as f:
        dets = json.load(f)
    by_img = defaultdict(list)
    for d in dets:
        if d["category_id"] == 1 and d["score"] >= thr:
            by_img[d["image_id"]].append(d)
    return by_img


@torch.no_grad()
def validate_on_dets(model, det_by_img, coco_gt, img_dir, args, device, epoch):
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    img_ids = sorted(det_by_img.keys())
    my_ids = img_ids[rank::world]
    ds = DetBoxDataset(det_by_img, my_ids, coco_gt, img_dir, image_size=[192, 256])
    loader = DataLoader(ds, batch_size=64, shuffle=False, num_workers=4, pin_memory=True)

    per_image = defaultdict(list)
    for img, meta in loader:
        img = img.to(device, non_blocking=True)
        hm = model(img)
        hm_f = torch.from_numpy(flip_back(model(img.flip(3)).cpu().numpy(), FLIP_PAIRS).copy()).to(device)
        hm_f[..., 1:] = hm_f.clone()[..., :-1]
        heat = ((hm + hm_f) * 0.5).cpu().numpy()
        kp, mv = get_final_preds(heat, meta["center"].numpy(), meta["scale"].numpy())
        for n in range(len(kp)):
            conf = mv[n, :, 0]
            vis = conf > args.in_vis_thre
            kpt_score = conf[vis].mean() if vis.any() else 0.0
            per_image[int(meta["image_id"][n])].append({
                "keypoints": np.concatenate([kp[n], mv[n]], 1),
                "score": float(kpt_score * meta["det_score"][n]),
                "area": float(meta["scale"][n][0] * meta["scale"][n][1] * 200 ** 2),
            })

    rows = []
    for image_id, cands in per_image.items():
        keep = oks_nms(cands, args.oks_thre)
        for i in keep:
            c = cands[i]
            rows.append(np.concatenate([[image_id, c["score"]], c["keypoints"].reshape(-1)]))
    local = torch.from_numpy(np.asarray(rows, dtype=np.float64).reshape(-1, 2 + 17 * 3)).to(device)

    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    if rank != 0:
        return 0.0
    allrows = torch.cat(gathered).cpu().numpy()
    results = [{"image_id": int(r[0]), "category_id": 1, "score": float(r[1]), "keypoints": r[2:].tolist()}
               for r in allrows]
    path = os.path.join(args.out, f"dets_val_ep{epoch}.json")
    with open(path, "w") as f:
        json.dump(results, f)
    E = COCOeval(coco_gt, coco_gt.loadRes(path), "keypoints")
    E.params.useSegm = None
    E.evaluate()
    E.accumulate()
    E.summarize()
    return float(E.stats[0])


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    train_ds = TopDownCocoDataset(args.data, "annotations/person_keypoints_train2017.json", "train2017",
                                  image_size=[192, 256], sigma=2, flip_pairs=FLIP_PAIRS, train=True)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=args.workers, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    coco_val = COCO(os.path.join(args.data, "annotations/person_keypoints_val2017.json"))
    det_by_img = load_detections(args.det_json, args.det_thr)
    val_img_dir = os.path.join(args.data, "val2017")

    model = nn.SyncBatchNorm.convert_sync_batchnorm(HRNetPose()).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [170, 200], 0.1)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        for i, (img, target, weight, _) in enumerate(train_dl):
            img = img.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            weight = weight.to(device, non_blocking=True)
            out = model(img)
            b, k = out.shape[:2]
            loss = 0.5 * F.mse_loss(out.view(b, k, -1) * weight, target.view(b, k, -1) * weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            stats += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and i % 200 == 0:
                print(f"[{epoch}:{i}/{len(train_dl)}] loss {loss.item():.6f}", flush=True)
        scheduler.step()
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch}: loss {(stats[0] / stats[1]).item():.6f} ({time.time() - t0:.0f}s)", flush=True)

        if (epoch + 1) % 10 == 0 or epoch + 1 == args.epochs:
            ap = validate_on_dets(model, det_by_img, coco_val, val_img_dir, args, device, epoch)
            if rank == 0:
                print(f"epoch {epoch}: det-box AP {ap:.4f}", flush=True)
                if ap > best:
                    best = ap
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        if rank == 0:
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "best": best}, os.path.join(args.out, "latest.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
