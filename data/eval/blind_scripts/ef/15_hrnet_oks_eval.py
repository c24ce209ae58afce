"""HRNet-W32 trainer with OKS-AP model selection (basketball + COCO mix).

Model selection is on val AP (OKS, COCO sigmas) computed with pycocotools.

    torchrun --nproc_per_node=4 hrnet_oks_eval.py --train-anns /mnt/bball/ann/train.json /mnt/datasets/coco/annotations/person_keypoints_train2017.json \
        --val-ann /mnt/bball/ann/val.json --out /mnt/bball/exp/w32_mix
"""
import argparse
import json
import logging
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
from torch.utils.data import ConcatDataset, DataLoader
from torch.utils.data.distributed import DistributedSampler

from sportpose.data import TopDownCocoDataset
from sportpose.transforms import flip_back, get_final_preds

FLIP_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]
logger = logging.getLogger("train")


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--train-anns", nargs="+", required=True)
    p.add_argument("--val-ann", required=True)
    p.add_argument("--img-root", default="/mnt/bball/images")
    p.add_argument("--out", default="/mnt/bball/exp/w32_mix")
    p.add_argument("--epochs", type=int, default=140)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--val-every", type=int, default=5)
    return p


class PoseHRNet(nn.Module):
    def __init__(self, num_joints=17):
        super().__init__()
        self.backbone = timm.create_model("hrnet_w32", pretrained=True, features_only=True,
                                          feature_location="", out_indices=(1,))
        self.final_layer = nn.Conv2d(self.backbone.feature_info.channels()[0], num_joints, 1)

    def forward(self, x):
        return self.final_layer(self.backbone(x)[0])


@torch.no_grad()
def predict(model, loader, device):
    model.eval()
    results = []
    for img, _, _, meta in loader:
        img = img.to(device, non_blocking=True)
        hm = model(img)
        hm_flip = flip_back(model(torch.flip(img, [3])).cpu().numpy(), FLIP_PAIRS)
        hm_flip = torch.from_numpy(hm_flip.copy()).to(device)
        hm_flip[:, :, :, 1:] = hm_flip.clone()[:, :, :, :-1]
        heat = ((hm + hm_flip) * 0.5).cpu().numpy()
        preds, maxvals = get_final_preds(heat, meta["center"].numpy(), meta["scale"].numpy())
        for n in range(len(preds)):
            good = maxvals[n, :, 0] > 0.2
            results.append({"image_id": int(meta["image_id"][n]), "category_id": 1,
                            "keypoints": np.concatenate([preds[n], maxvals[n]], axis=1).ravel().tolist(),
                            "score": float(maxvals[n, good, 0].mean()) if good.any() else 0.0})
    return results


def oks_ap(coco_gt, results, res_file):
    with open(res_file, "w") as f:
        json.dump(results, f)
    coco_dt = coco_gt.loadRes(res_file)
    E = COCOeval(coco_gt, coco_dt, "keypoints")
    E.params.useSegm = None
    E.params.imgIds = sorted({r["image_id"] for r in results})
    E.evaluate()
    E.accumulate()
    E.summarize()
    names = ["AP", "AP50", "AP75", "APm", "APl", "AR", "AR50", "AR75", "ARm", "ARl"]
    return dict(zip(names, E.stats.tolist()))


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN, format="%(asctime)s | %(message)s")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    kw = dict(image_size=[192, 256], sigma=2, flip_pairs=FLIP_PAIRS)
    train_ds = ConcatDataset([TopDownCocoDataset(None, a, args.img_root, train=True, **kw) for a in args.train_anns])
    val_ds = TopDownCocoDataset(None, args.val_ann, args.img_root, train=False, **kw)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=64, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=args.workers, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(PoseHRNet()).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[90, 120], gamma=0.1)

    best_ap = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        loss_sum = torch.zeros(2, device=device)
        for it, (img, target, weight, _) in enumerate(train_dl):
            img = img.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            weight = weight.to(device, non_blocking=True)
            out = model(img)
            b, k = out.shape[:2]
            loss = 0.5 * F.mse_loss(out.reshape(b, k, -1) * weight, target.reshape(b, k, -1) * weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach() * b, torch.tensor(float(b), device=device)])
            if it % 100 == 0:
                logger.info("epoch %d iter %d/%d loss %.6f", epoch, it, len(train_dl), loss.item())
        scheduler.step()
        dist.all_reduce(loss_sum)
        logger.info("epoch %d train loss %.6f (%.0fs)", epoch, (loss_sum[0] / loss_sum[1]).item(), time.time() - tic)

        if (epoch + 1) % args.val_every == 0 or epoch + 1 == args.epochs:
            results = predict(model, val_dl, device)
            if rank == 0:
                metrics = oks_ap(val_ds.coco, results, os.path.join(args.out, "val_results.json"))
                logger.info("epoch %d val %s", epoch, " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
                if metrics["AP"] > best_ap:
                    best_ap = metrics["AP"]
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best_ap.pth"))
                    logger.info("new best AP %.4f", best_ap)

        if rank == 0:
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "best_ap": best_ap},
                       os.path.join(args.out, "checkpoint.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
