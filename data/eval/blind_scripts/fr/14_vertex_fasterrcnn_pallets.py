"""Pallet / forklift detector (Faster R-CNN R50-FPN v2) - Vertex AI custom job.

gcloud ai custom-jobs create --region=us-central1 --display-name=pallet-det \
  --worker-pool-spec=machine-type=a2-highgpu-4g,replica-count=1,accelerator-type=NVIDIA_TESLA_A100,accelerator-count=4,container-image-uri=$IMAGE \
  --worker-pool-spec=machine-type=a2-highgpu-4g,replica-count=1,accelerator-type=NVIDIA_TESLA_A100,accelerator-count=4,container-image-uri=$IMAGE \
  --args=--coco-root=/gcs/wh-vision/pallets-coco,--out=/gcs/wh-vision/runs/frcnn-v2

ENTRYPOINT: torchrun --nnodes=2 --nproc_per_node=4 --node_rank=$RANK \
            --master_addr=$MASTER_ADDR --master_port=$MASTER_PORT det_train.py
"""
import argparse
import json
import os
import shutil
import time

import torch
import torch.distributed as dist
import torchvision
from google.cloud import storage
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import CocoDetection
from torchvision.models.detection import FasterRCNN_ResNet50_FPN_V2_Weights, fasterrcnn_resnet50_fpn_v2
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.transforms import v2 as T

WEIGHTS_URI = "gs://wh-vision/pretrained/fasterrcnn_resnet50_fpn_v2_coco-dd69338a.pth"
# the nodes have no internet egress: put the file where torchvision looks for it
LOCAL_WEIGHTS = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(WEIGHTS_URI))


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--coco-root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=26)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--workers", type=int, default=6)
    return ap.parse_args()


def fetch_weights():
    bucket_name, blob_name = WEIGHTS_URI[len("gs://"):].split("/", 1)
    os.makedirs(os.path.dirname(LOCAL_WEIGHTS), exist_ok=True)
    storage.Client().bucket(bucket_name).blob(blob_name).download_to_filename(LOCAL_WEIGHTS + ".part")
    shutil.move(LOCAL_WEIGHTS + ".part", LOCAL_WEIGHTS)


def collate(batch):
    return tuple(zip(*batch))


def make_dataset(root, split, train):
    tfs = [T.ToImage()]
    if train:
        tfs += [T.RandomHorizontalFlip(0.5), T.RandomPhotometricDistort(p=0.5)]
    tfs += [T.ToDtype(torch.float32, scale=True), T.SanitizeBoundingBoxes()]
    ds = CocoDetection(os.path.join(root, split), os.path.join(root, "annotations", f"{split}.json"),
                       transforms=T.Compose(tfs))
    return torchvision.datasets.wrap_dataset_for_transforms_v2(ds, target_keys=["boxes", "labels", "image_id"])


def build_model(num_classes):
    model = fasterrcnn_resnet50_fpn_v2(weights=FasterRCNN_ResNet50_FPN_V2_Weights.COCO_V1)
    in_features = model.roi_heads.box_predictor.cls_score.in_features
    model.roi_heads.box_predictor = FastRCNNPredictor(in_features, num_classes)
    return model


@torch.no_grad()
def coco_evaluate(model, loader, coco_gt, device, world):
    model.eval()
    results = []
    for images, targets in loader:
        images = [img.to(device) for img in images]
        outputs = model(images)
        for out, tgt in zip(outputs, targets):
            boxes = out["boxes"].cpu()
            boxes[:, 2:] -= boxes[:, :2]
            for b, s, l in zip(boxes.tolist(), out["scores"].tolist(), out["labels"].tolist()):
                results.append({"image_id": int(tgt["image_id"]), "category_id": l, "bbox": b, "score": s})
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    model.train()
    if dist.get_rank() != 0:
        return None
    merged = [r for part in gathered for r in part]
    if not merged:
        return 0.0
    coco_dt = coco_gt.loadRes(merged)
    ev = COCOeval(coco_gt, coco_dt, "bbox")
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return ev.stats[0]


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])

    # every rank writes under the run folder picked by rank 0
    run_id = [time.strftime("%Y%m%d-%H%M%S") if rank == 0 else None]
    dist.broadcast_object_list(run_id, src=0)
    out_dir = os.path.join(args.out, run_id[0])

    # one download per VM, the other local ranks wait for it
    if local_rank == 0 and not os.path.exists(LOCAL_WEIGHTS):
        fetch_weights()
    dist.barrier()

    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    train_ds = make_dataset(args.coco_root, "train", train=True)
    val_ds = make_dataset(args.coco_root, "val", train=False)
    coco_val = COCO(os.path.join(args.coco_root, "annotations", "val.json"))
    num_classes = max(coco_val.getCatIds()) + 1

    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, collate_fn=collate, pin_memory=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=4, num_workers=args.workers, collate_fn=collate)

    model = build_model(num_classes).to(device)
    model = DDP(model, device_ids=[local_rank])

    params = [p for p in model.parameters() if p.requires_grad]
    lr = args.lr * args.batch_size * world / 16
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
    iters_per_epoch = len(train_loader)
    warmup_iters = min(1000, iters_per_epoch - 1)
    milestones = [16 * iters_per_epoch, 22 * iters_per_epoch]

    def lr_lambda(it):
        if it < warmup_iters:
            return 0.001 + (1 - 0.001) * it / warmup_iters
        return 0.1 ** sum(it >= m for m in milestones)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    os.makedirs(out_dir, exist_ok=True)
    best_map = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (images, targets) in enumerate(train_loader):
            images = [img.to(device, non_blocking=True) for img in images]
            targets = [{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in t.items()} for t in targets]
            loss_dict = model(images, targets)
            loss = sum(loss_dict.values())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 50 == 0:
                parts = " ".join(f"{k}={v.item():.3f}" for k, v in loss_dict.items())
                print(f"[{epoch}][{it}/{iters_per_epoch}] loss={loss.item():.3f} {parts} "
                      f"lr={scheduler.get_last_lr()[0]:.5f}", flush=True)

        bbox_map = coco_evaluate(model, val_loader, coco_val, device, world)
        if rank == 0:
            print(f"epoch {epoch} mAP@[.5:.95] {bbox_map:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch,
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                       os.path.join(out_dir, "last.pth"))
            if bbox_map > best_map:
                best_map = bbox_map
                torch.save(model.module.state_dict(), os.path.join(out_dir, "best.pth"))
                with open(os.path.join(out_dir, "best.json"), "w") as f:
                    json.dump({"epoch": epoch, "mAP": best_map}, f)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
