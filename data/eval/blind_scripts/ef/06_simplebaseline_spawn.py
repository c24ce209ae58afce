"""SimpleBaseline ResNet-50 256x192, single-node multi-GPU via mp.spawn.

Kept on mp.spawn because the lab workstations run it from the scheduler
wrapper that only knows how to call `python script.py`.

    python simplebaseline_spawn.py --data /data/coco --out /data/runs/sb50 --gpus 4
"""
import argparse
import json
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torchvision
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from sportpose.data import TopDownFromRecords, build_records
from sportpose.transforms import flip_back, get_final_preds

FLIP_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/coco")
    p.add_argument("--out", default="/data/runs/sb50")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--port", type=int, default=29531)
    p.add_argument("--epochs", type=int, default=140)
    p.add_argument("--batch-size", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--resume", default="")
    return p.parse_args()


class PoseResNet(nn.Module):
    def __init__(self, num_joints=17):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V1")
        self.backbone = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3, r.layer4)
        layers, cin = [], 2048
        for _ in range(3):
            layers += [nn.ConvTranspose2d(cin, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(inplace=True)]
            cin = 256
        self.deconv = nn.Sequential(*layers)
        self.final_layer = nn.Conv2d(256, num_joints, 1)

    def forward(self, x):
        return self.final_layer(self.deconv(self.backbone(x)))


def records_cached(split, data_root, out_dir, rank):
    """Parse the annotation json once (rank 0), everybody else reads the pickle."""
    cache = os.path.join(out_dir, f"records_{split}.pkl")
    if rank == 0 and not os.path.exists(cache):
        recs = build_records(os.path.join(data_root, "annotations", f"person_keypoints_{split}.json"),
                             os.path.join(data_root, split))
        tmp = cache + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump(recs, f)
        os.replace(tmp, cache)
    dist.barrier()
    with open(cache, "rb") as f:
        return pickle.load(f)


def evaluate(model, loader, coco_gt, gpu, out_dir):
    model.eval()
    out = []
    with torch.no_grad():
        for img, _, _, meta in loader:
            img = img.cuda(gpu, non_blocking=True)
            hm = model(img)
            hm_flip = flip_back(model(img.flip(3)).cpu().numpy(), FLIP_PAIRS)
            hm_flip = torch.from_numpy(hm_flip.copy()).cuda(gpu)
            hm_flip[:, :, :, 1:] = hm_flip.clone()[:, :, :, :-1]
            heat = (0.5 * (hm + hm_flip)).cpu().numpy()
            preds, maxvals = get_final_preds(heat, meta["center"].numpy(), meta["scale"].numpy())
            for n in range(heat.shape[0]):
                sel = maxvals[n, :, 0] > 0.2
                out.append({"index": int(meta["index"][n]), "image_id": int(meta["image_id"][n]),
                            "category_id": 1, "score": float(maxvals[n, sel, 0].mean()) if sel.any() else 0.0,
                            "keypoints": np.concatenate([preds[n], maxvals[n]], 1).reshape(-1).tolist()})
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, out)
    if dist.get_rank() != 0:
        return None
    uniq = {}
    for part in everything:
        for d in part:
            uniq[d.pop("index")] = d
    res_file = os.path.join(out_dir, "results_val2017.json")
    with open(res_file, "w") as f:
        json.dump(list(uniq.values()), f)
    ev = COCOeval(coco_gt, coco_gt.loadRes(res_file), "keypoints")
    ev.params.useSegm = None
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return ev.stats[0]


def main_worker(gpu, ngpus, args):
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", world_size=ngpus, rank=gpu)
    rank = gpu
    torch.backends.cudnn.benchmark = True

    train_recs = records_cached("train2017", args.data, args.out, rank)
    val_recs = records_cached("val2017", args.data, args.out, rank)
    train_ds = TopDownFromRecords(train_recs, image_size=(192, 256), sigma=2, flip_pairs=FLIP_PAIRS, train=True)
    val_ds = TopDownFromRecords(val_recs, image_size=(192, 256), sigma=2, flip_pairs=FLIP_PAIRS, train=False)
    train_sampler = DistributedSampler(train_ds, num_replicas=ngpus, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=ngpus, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=val_sampler, num_workers=args.workers, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(PoseResNet()).cuda(gpu)
    model = DDP(model, device_ids=[gpu])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [90, 120], 0.1)
    coco_val = COCO(os.path.join(args.data, "annotations", "person_keypoints_val2017.json")) if rank == 0 else None

    start_epoch, best_ap = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=f"cuda:{gpu}")
        model.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_ap = ckpt["epoch"] + 1, ckpt["best_ap"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        meter = torch.zeros(2, device=f"cuda:{gpu}")
        tic = time.time()
        for i, (img, target, target_weight, _) in enumerate(train_loader):
            img = img.cuda(gpu, non_blocking=True)
            target = target.cuda(gpu, non_blocking=True)
            target_weight = target_weight.cuda(gpu, non_blocking=True)
            out = model(img)
            b, k = out.shape[:2]
            loss = 0.5 * nn.functional.mse_loss(out.view(b, k, -1) * target_weight, target.view(b, k, -1) * target_weight)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            meter[0] += loss.detach()
            meter[1] += 1
            if rank == 0 and i % 200 == 0:
                print(f"ep {epoch} it {i}/{len(train_loader)} loss {loss.item():.6f}", flush=True)
        scheduler.step()
        dist.all_reduce(meter)
        if rank == 0:
            print(f"ep {epoch} avg loss {(meter[0] / meter[1]).item():.6f} ({time.time() - tic:.0f}s)", flush=True)

        ap = None
        if (epoch + 1) % 10 == 0:
            ap = evaluate(model, val_loader, coco_val, gpu, args.out)
        if rank == 0:
            if ap is not None and ap > best_ap:
                best_ap = ap
                torch.save(model.module.state_dict(), os.path.join(args.out, "model_best.pth"))
            torch.save({"epoch": epoch, "state_dict": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "best_ap": best_ap},
                       os.path.join(args.out, "checkpoint.pth"))

    dist.destroy_process_group()


def main():
    args = get_args()
    os.makedirs(args.out, exist_ok=True)
    ngpus = args.gpus
    mp.spawn(main_worker, nprocs=ngpus, args=(ngpus, args), join=True)


if __name__ == "__main__":
    main()
