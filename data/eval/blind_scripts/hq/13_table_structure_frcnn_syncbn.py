"""Table structure recognition (rows / columns / header / spanning cells) on cropped tables
with Faster R-CNN R50-FPN v2. The v2 model has BatchNorm in backbone, FPN and box head, so
it is converted to SyncBatchNorm across all GPUs.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        13_table_structure_frcnn_syncbn.py --data /shared/pubtables_structure --out /shared/runs/tsr_frcnn
"""
import argparse
import math
import os
import pickle
import time

import torch
import torch.distributed as dist
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import ResNet50_Weights
from torchvision.models.detection import fasterrcnn_resnet50_fpn_v2
from torchvision.transforms import functional as TF

CATEGORIES = {1: "table row", 2: "table column", 3: "table column header", 4: "table spanning cell"}


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="folder with images/, train.json, val.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=24)
    ap.add_argument("--batch_size", type=int, default=2, help="images per GPU")
    ap.add_argument("--base_lr", type=float, default=0.02, help="lr for a global batch of 16")
    ap.add_argument("--warmup_iters", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=4)
    return ap.parse_args()


def build_index(coco):
    index = []
    for img_id in sorted(coco.getImgIds()):
        info = coco.loadImgs(img_id)[0]
        anns = [a for a in coco.loadAnns(coco.getAnnIds(imgIds=img_id)) if a["bbox"][2] > 1 and a["bbox"][3] > 1]
        boxes = [[a["bbox"][0], a["bbox"][1], a["bbox"][0] + a["bbox"][2], a["bbox"][1] + a["bbox"][3]] for a in anns]
        index.append((img_id, info["file_name"], boxes, [a["category_id"] for a in anns]))
    return index


class TableCrops(Dataset):
    def __init__(self, img_dir, index, train):
        self.img_dir, self.index, self.train = img_dir, index, train

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        img_id, fname, boxes, labels = self.index[i]
        img = TF.to_tensor(Image.open(os.path.join(self.img_dir, fname)).convert("RGB"))
        target = {
            "boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
            "labels": torch.tensor(labels, dtype=torch.int64),
            "image_id": img_id,
        }
        return img, target


def collate(batch):
    return tuple(zip(*batch))


@torch.no_grad()
def evaluate(model, loader, coco_gt, device):
    model.eval()
    per_image = {}
    for images, targets in loader:
        outputs = model([im.to(device) for im in images])
        for t, o in zip(targets, outputs):
            dets = []
            for box, score, label in zip(o["boxes"].tolist(), o["scores"].tolist(), o["labels"].tolist()):
                dets.append({"image_id": t["image_id"], "category_id": label, "score": score,
                             "bbox": [box[0], box[1], box[2] - box[0], box[3] - box[1]]})
            per_image[t["image_id"]] = dets
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, per_image)
    model.train()
    if dist.get_rank() != 0:
        return None
    merged = {}
    for part in gathered:
        merged.update(part)  # repeated (padded) images just overwrite themselves
    results = [d for dets in merged.values() for d in dets]
    if not results:
        return 0.0
    coco_dt = coco_gt.loadRes(results)
    ev = COCOeval(coco_gt, coco_dt, "bbox")
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return ev.stats[0]


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # parsing the 900k-box annotation file is slow: rank 0 builds the index once, the others wait and read it
    cache = os.path.join(args.out, "index_cache.pkl")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        if not os.path.exists(cache):
            tmp = cache + ".tmp"
            with open(tmp, "wb") as f:
                pickle.dump({s: build_index(COCO(os.path.join(args.data, f"{s}.json"))) for s in ("train", "val")}, f)
            os.replace(tmp, cache)
    dist.barrier()
    with open(cache, "rb") as f:
        index = pickle.load(f)
    coco_val = COCO(os.path.join(args.data, "val.json")) if rank == 0 else None

    img_dir = os.path.join(args.data, "images")
    train_set = TableCrops(img_dir, index["train"], train=True)
    val_set = TableCrops(img_dir, index["val"], train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=4, sampler=DistributedSampler(val_set, shuffle=False),
                            collate_fn=collate, num_workers=args.workers)

    model = fasterrcnn_resnet50_fpn_v2(weights=None, weights_backbone=ResNet50_Weights.IMAGENET1K_V1,
                                       num_classes=len(CATEGORIES) + 1, trainable_backbone_layers=5,
                                       min_size=800, max_size=1333, box_detections_per_img=300)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.base_lr * args.batch_size * world / 16
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
    iters_per_epoch = len(train_loader)
    total_iters = args.epochs * iters_per_epoch
    milestones = [int(total_iters * 2 / 3), int(total_iters * 8 / 9)]

    def lr_lambda(it):
        warm = min(1.0, (it + 1) / args.warmup_iters) if args.warmup_iters else 1.0
        return warm * (0.1 ** sum(it >= m for m in milestones))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    scaler = torch.cuda.amp.GradScaler()
    if rank == 0:
        print(f"world {world}, global batch {args.batch_size * world}, lr {lr:.4f}, {total_iters} iters", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (images, targets) in enumerate(train_loader):
            images = [im.to(device, non_blocking=True) for im in images]
            targets = [{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in t.items()} for t in targets]
            with torch.autocast("cuda", dtype=torch.float16):
                loss_dict = model(images, targets)
                loss = sum(loss_dict.values())
            if not math.isfinite(loss.item()):
                raise RuntimeError(f"rank {rank}: non-finite loss {loss_dict}")
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it}/{iters_per_epoch} loss {loss.item():.3f} "
                      + " ".join(f"{k}={v.item():.3f}" for k, v in loss_dict.items())
                      + f" lr {scheduler.get_last_lr()[0]:.4f} {time.time() - t0:.0f}s", flush=True)

        ap = evaluate(model, val_loader, coco_val, device)
        if rank == 0:
            print(f"epoch {epoch}: AP {ap:.4f}", flush=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "ap": ap}
            torch.save(state, os.path.join(args.out, "last.pth"))
            if ap > best:
                best = ap
                torch.save(state, os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
