"""
Table detection on document page images (TableBank / PubLayNet "table" class,
COCO-format annotations) with torchvision Faster R-CNN, one process per GPU
started with torch.multiprocessing.spawn.

    python train_table_det.py --img-dir /data/pubtables/images --train-json ann/train.json \
        --val-json ann/val.json --gpus 4
"""
import argparse
import os
import socket

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.detection import fasterrcnn_resnet50_fpn_v2
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
import torchvision.transforms.functional as TF


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--img-dir", required=True)
    p.add_argument("--train-json", required=True)
    p.add_argument("--val-json", required=True)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--batch-size", type=int, default=4, help="images per GPU")
    p.add_argument("--epochs", type=int, default=24)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--out", default="work_dirs/table_frcnn")
    p.add_argument("--resume", default="")
    return p.parse_args()


class CocoTables(Dataset):
    def __init__(self, img_dir, ann_file, train):
        self.img_dir = img_dir
        self.coco = COCO(ann_file)
        self.ids = sorted(self.coco.getImgIds())
        if train:
            self.ids = [i for i in self.ids if len(self.coco.getAnnIds(imgIds=i, iscrowd=False)) > 0]
        self.train = train

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, idx):
        img_id = self.ids[idx]
        info = self.coco.loadImgs(img_id)[0]
        img = Image.open(os.path.join(self.img_dir, info["file_name"])).convert("RGB")
        anns = self.coco.loadAnns(self.coco.getAnnIds(imgIds=img_id, iscrowd=False))
        boxes = torch.tensor([[a["bbox"][0], a["bbox"][1], a["bbox"][0] + a["bbox"][2], a["bbox"][1] + a["bbox"][3]]
                              for a in anns], dtype=torch.float32).reshape(-1, 4)
        labels = torch.ones((boxes.shape[0],), dtype=torch.int64)
        img = TF.to_tensor(img)
        if self.train and np.random.rand() < 0.5:
            img = img.flip(-1)
            w = img.shape[-1]
            boxes = boxes[:, [2, 1, 0, 3]] * torch.tensor([-1, 1, -1, 1]) + torch.tensor([w, 0, w, 0])
        return img, {"boxes": boxes, "labels": labels, "image_id": img_id}


def collate(batch):
    return tuple(zip(*batch))


def build_model():
    model = fasterrcnn_resnet50_fpn_v2(weights="DEFAULT", min_size=800, max_size=1333)
    in_f = model.roi_heads.box_predictor.cls_score.in_features
    model.roi_heads.box_predictor = FastRCNNPredictor(in_f, 2)  # background + table
    return model


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@torch.no_grad()
def evaluate(model, loader, coco_gt, device, rank, world_size):
    model.eval()
    results = []
    for imgs, targets in loader:
        imgs = [im.to(device) for im in imgs]
        outputs = model(imgs)
        for out, tgt in zip(outputs, targets):
            b = out["boxes"].cpu().numpy()
            for box, score in zip(b, out["scores"].cpu().tolist()):
                results.append({"image_id": tgt["image_id"], "category_id": 1, "score": score,
                                "bbox": [float(box[0]), float(box[1]), float(box[2] - box[0]), float(box[3] - box[1])]})
    gathered = [None] * world_size
    dist.all_gather_object(gathered, results)
    stats = None
    if rank == 0:
        merged = {(r["image_id"], tuple(r["bbox"]), r["score"]): r for part in gathered for r in part}
        dets = list(merged.values())
        if dets:
            coco_dt = coco_gt.loadRes(dets)
            ev = COCOeval(coco_gt, coco_dt, "bbox")
            ev.evaluate()
            ev.accumulate()
            ev.summarize()
            stats = ev.stats
    return stats


def worker(rank, world_size, port, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(1234)

    train_ds = CocoTables(args.img_dir, args.train_json, train=True)
    val_ds = CocoTables(args.img_dir, args.val_json, train=False)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          collate_fn=collate, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=2, sampler=val_sampler, num_workers=args.workers, collate_fn=collate)

    model = build_model()
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[rank])
    params = [p for p in model.parameters() if p.requires_grad]
    # linear scaling rule: base lr 0.02 is for 16 images per iteration
    lr = args.lr * args.batch_size * world_size / 16
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[16, 22], gamma=0.1)
    warmup_iters = min(1000, len(train_dl) - 1)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for i, (imgs, targets) in enumerate(train_dl):
            if epoch == 0 and i <= warmup_iters:
                f = 0.001 + (1 - 0.001) * i / warmup_iters
                for g in optimizer.param_groups:
                    g["lr"] = lr * f
            imgs = [im.to(device, non_blocking=True) for im in imgs]
            targets = [{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in t.items()} for t in targets]
            loss_dict = model(imgs, targets)
            loss = sum(loss_dict.values())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if rank == 0 and i % 50 == 0:
                parts = " ".join(f"{k}={v.item():.3f}" for k, v in loss_dict.items())
                print(f"epoch {epoch} [{i}/{len(train_dl)}] loss {loss.item():.4f} {parts}", flush=True)
        scheduler.step()

        stats = evaluate(model.module, val_dl, val_ds.coco, device, rank, world_size)
        if rank == 0:
            print(f"epoch {epoch}: AP {stats[0]:.4f} AP50 {stats[1]:.4f} AP75 {stats[2]:.4f}" if stats is not None
                  else f"epoch {epoch}: no detections", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"epoch_{epoch:02d}.pth"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    world_size = args.gpus
    port = free_port()
    mp.spawn(worker, args=(world_size, port, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
