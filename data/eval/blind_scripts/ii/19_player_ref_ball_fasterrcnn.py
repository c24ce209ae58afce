"""Detector for the tracking pipeline: player / goalkeeper / referee / ball boxes
in broadcast soccer frames. torchvision Faster R-CNN (ResNet-50 FPN v2, COCO
init), COCO-format annotations exported from the labelling tool.

    torchrun --nproc_per_node=8 19_player_ref_ball_fasterrcnn.py --train-json ann/train.json --val-json ann/val.json
"""
import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torchvision
from pycocotools.coco import COCO
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchmetrics.detection import MeanAveragePrecision
from torchvision.models.detection import FasterRCNN_ResNet50_FPN_V2_Weights, fasterrcnn_resnet50_fpn_v2
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.transforms.v2 import functional as TF

CATEGORIES = ["player", "goalkeeper", "referee", "ball"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--img-root", default="/data/sn-det/images")
    p.add_argument("--train-json", required=True)
    p.add_argument("--val-json", required=True)
    p.add_argument("--batch-size", type=int, default=4, help="images per GPU")
    p.add_argument("--epochs", type=int, default=26)
    p.add_argument("--lr", type=float, default=0.02, help="SGD lr for 16 images")
    p.add_argument("--lr-steps", type=int, nargs="+", default=[16, 22])
    p.add_argument("--output-dir", default="runs/frcnn_sn")
    p.add_argument("--resume", default="")
    return p.parse_args()


class CocoFrames(Dataset):
    def __init__(self, img_root, ann_file, train):
        self.coco = COCO(ann_file)
        self.ids = sorted(self.coco.getImgIds())
        self.root, self.train = img_root, train
        self.cat_map = {c["id"]: CATEGORIES.index(c["name"]) + 1 for c in self.coco.loadCats(self.coco.getCatIds())}

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img_id = self.ids[i]
        info = self.coco.loadImgs(img_id)[0]
        img = TF.to_image(Image.open(os.path.join(self.root, info["file_name"])).convert("RGB"))
        anns = [a for a in self.coco.loadAnns(self.coco.getAnnIds(imgIds=img_id)) if not a.get("iscrowd", 0)]
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        labels = torch.tensor([self.cat_map[a["category_id"]] for a in anns], dtype=torch.int64)
        if self.train and torch.rand(1) < 0.5:
            img = TF.horizontal_flip(img)
            w = img.shape[-1]
            boxes[:, [0, 2]] = w - boxes[:, [2, 0]]
        return TF.to_dtype(img, torch.float32, scale=True), {"boxes": boxes, "labels": labels, "image_id": img_id}


def collate(batch):
    return tuple(zip(*batch))


def build_model():
    model = fasterrcnn_resnet50_fpn_v2(weights=FasterRCNN_ResNet50_FPN_V2_Weights.COCO_V1,
                                       min_size=720, max_size=1280, box_detections_per_img=100,
                                       rpn_pre_nms_top_n_train=3000, rpn_post_nms_top_n_train=2000)
    in_features = model.roi_heads.box_predictor.cls_score.in_features
    model.roi_heads.box_predictor = FastRCNNPredictor(in_features, len(CATEGORIES) + 1)
    return model


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    metric = MeanAveragePrecision(iou_type="bbox", class_metrics=True).to(device)
    for images, targets in loader:
        images = [im.to(device, non_blocking=True) for im in images]
        preds = model(images)
        metric.update(preds, [{k: v.to(device) for k, v in t.items() if k != "image_id"} for t in targets])
    res = metric.compute()          # torchmetrics gathers the states from all ranks
    model.train()
    return res


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = CocoFrames(args.img_root, args.train_json, train=True)
    val_ds = CocoFrames(args.img_root, args.val_json, train=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=DistributedSampler(train_ds, shuffle=True),
                              num_workers=6, collate_fn=collate, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), batch_size=4,
                            num_workers=6, collate_fn=collate)

    model = build_model()
    # the v2 FPN and box head use BatchNorm; 4 images per GPU is too few for per-GPU statistics
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 16
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
    warmup_iters = min(1000, len(train_loader) - 1)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1e-3, total_iters=warmup_iters)
    milestones = [e * len(train_loader) for e in args.lr_steps]
    step_sched = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.1)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step_sched.load_state_dict(ckpt["lr_scheduler"])
        start_epoch = ckpt["epoch"] + 1
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    it_global = start_epoch * len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        for it, (images, targets) in enumerate(train_loader):
            images = [im.to(device, non_blocking=True) for im in images]
            targets = [{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in t.items()} for t in targets]
            loss_dict = model(images, targets)
            loss = sum(loss_dict.values())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if it_global < warmup_iters:
                warmup.step()
            step_sched.step()
            it_global += 1
            if rank == 0 and it % 50 == 0:
                parts = " ".join(f"{k}={v.item():.3f}" for k, v in loss_dict.items())
                print(f"epoch {epoch} [{it}/{len(train_loader)}] loss={loss.item():.3f} {parts} "
                      f"lr={optimizer.param_groups[0]['lr']:.5f}", flush=True)

        res = evaluate(model.module, val_loader, device)
        if rank == 0:
            per_cls = {CATEGORIES[int(c) - 1]: round(v.item(), 4) for c, v in zip(res["classes"], res["map_per_class"])}
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s: mAP {res['map'].item():.4f} "
                  f"mAP50 {res['map_50'].item():.4f} per class {per_cls}", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "lr_scheduler": step_sched.state_dict(), "epoch": epoch},
                       os.path.join(args.output_dir, f"model_{epoch}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
