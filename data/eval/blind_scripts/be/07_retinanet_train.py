# RetinaNet (R50-FPN, 1x / 3x) trainer with multi-scale training, warmup and COCO eval.
#
# launch:
#   torchrun --nnodes=1 --nproc_per_node=8 07_retinanet_train.py --cfg configs/retinanet_r50_3x.yaml \
#       --resume output/retinanet_r50_3x/last.pth
import argparse
import json
import os
import random
import time

import torch
import torch.distributed as dist
import yaml
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.models.detection import retinanet_resnet50_fpn_v2
from torchvision.models import ResNet50_Weights

from data.coco import COCODetectionDataset, detection_collate
from data.transforms import build_transforms

DEFAULTS = {
    "data_root": "/data/coco",
    "num_classes": 91,
    "ims_per_gpu": 2,
    "base_lr": 0.01,
    "momentum": 0.9,
    "weight_decay": 1e-4,
    "max_epochs": 36,
    "lr_steps": [28, 33],
    "warmup_iters": 1000,
    "warmup_factor": 0.001,
    "min_sizes": [640, 672, 704, 736, 768, 800],
    "max_size": 1333,
    "output_dir": "output/retinanet",
    "log_period": 20,
}


def load_cfg(path):
    cfg = dict(DEFAULTS)
    if path:
        with open(path) as f:
            cfg.update(yaml.safe_load(f) or {})
    return cfg


def lr_at(cfg, it, epoch):
    lr = cfg["base_lr"] * (0.1 ** sum(epoch >= s for s in cfg["lr_steps"]))
    if it < cfg["warmup_iters"]:
        alpha = it / cfg["warmup_iters"]
        lr *= cfg["warmup_factor"] * (1 - alpha) + alpha
    return lr


@torch.no_grad()
def run_coco_eval(model, loader, dataset, device):
    model.eval()
    results = []
    for images, targets in loader:
        images = [im.to(device, non_blocking=True) for im in images]
        outputs = model(images)
        for tgt, out in zip(targets, outputs):
            scale = tgt["scale"]
            boxes = (out["boxes"] / scale).cpu()
            boxes[:, 2:] -= boxes[:, :2]
            img_id = int(tgt["image_id"])
            for b, s, l in zip(boxes.tolist(), out["scores"].tolist(), out["labels"].tolist()):
                results.append({"image_id": img_id, "category_id": dataset.contiguous_to_coco[l],
                                "bbox": [round(x, 2) for x in b], "score": round(s, 4)})
    all_results = [None] * dist.get_world_size()
    dist.all_gather_object(all_results, results)
    model.train()
    if dist.get_rank() != 0:
        return None
    merged, seen = [], set()
    for part in all_results:
        for r in part:
            key = (r["image_id"], tuple(r["bbox"]), r["category_id"])
            if key not in seen:
                seen.add(key)
                merged.append(r)
    if not merged:
        return 0.0
    coco_dt = dataset.coco.loadRes(merged)
    ev = COCOeval(dataset.coco, coco_dt, "bbox")
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return float(ev.stats[0])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", default="")
    parser.add_argument("--resume", default="")
    parser.add_argument("--eval-only", action="store_true")
    args = parser.parse_args()
    cfg = load_cfg(args.cfg)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(0)
    if rank == 0:
        os.makedirs(cfg["output_dir"], exist_ok=True)

    train_set = COCODetectionDataset(cfg["data_root"], "train2017",
                                     build_transforms(cfg["min_sizes"], cfg["max_size"], train=True))
    val_set = COCODetectionDataset(cfg["data_root"], "val2017",
                                   build_transforms([800], cfg["max_size"], train=False))
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=cfg["ims_per_gpu"], sampler=train_sampler, num_workers=4,
                              collate_fn=detection_collate, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=val_sampler, num_workers=4,
                            collate_fn=detection_collate, pin_memory=True)

    model = retinanet_resnet50_fpn_v2(weights=None, weights_backbone=ResNet50_Weights.IMAGENET1K_V2,
                                      num_classes=cfg["num_classes"], min_size=800, max_size=cfg["max_size"])
    model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=cfg["base_lr"], momentum=cfg["momentum"],
                                weight_decay=cfg["weight_decay"])

    start_epoch, it, best_ap = 0, 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        checkpoint = torch.load(args.resume)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        start_epoch = checkpoint["epoch"] + 1
        it = checkpoint["iter"]
        best_ap = checkpoint.get("best_ap", 0.0)
        if rank == 0:
            print(f"resumed from {args.resume} (epoch {checkpoint['epoch']}, AP {best_ap:.4f})")

    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    if args.eval_only:
        ap = run_coco_eval(model.module, val_loader, val_set, device)
        if rank == 0:
            print(f"bbox AP: {ap:.4f}")
        dist.destroy_process_group()
        return

    for epoch in range(start_epoch, cfg["max_epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for images, targets in train_loader:
            images = [im.to(device, non_blocking=True) for im in images]
            targets = [{k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in t.items()}
                       for t in targets]
            lr = lr_at(cfg, it, epoch)
            for g in optimizer.param_groups:
                g["lr"] = lr

            loss_dict = model(images, targets)
            loss = loss_dict["classification"] + loss_dict["bbox_regression"]
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 35.0)
            optimizer.step()
            it += 1

            if it % cfg["log_period"] == 0:
                logged = torch.stack([loss_dict["classification"].detach(), loss_dict["bbox_regression"].detach()])
                dist.all_reduce(logged)
                logged /= world
                if rank == 0:
                    print(f"epoch {epoch} iter {it} cls {logged[0]:.4f} reg {logged[1]:.4f} lr {lr:.5f} "
                          f"{(time.time() - t0) / cfg['log_period']:.3f}s/it", flush=True)
                    t0 = time.time()

        ap = run_coco_eval(model.module, val_loader, val_set, device)
        if rank == 0:
            print(f"epoch {epoch}: bbox AP {ap:.4f}")
            is_best = ap > best_ap
            best_ap = max(ap, best_ap)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch, "iter": it, "best_ap": best_ap}
            torch.save(state, os.path.join(cfg["output_dir"], "last.pth"))
            if is_best:
                torch.save(state, os.path.join(cfg["output_dir"], "best.pth"))
            with open(os.path.join(cfg["output_dir"], "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "AP": ap}) + "\n")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
