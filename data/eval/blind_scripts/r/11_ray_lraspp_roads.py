"""Road / lane-marking segmentation (3 classes) with torchvision LR-ASPP MobileNetV3.

Started as a single-GPU notebook, moved to Ray Train for the 4-GPU workstation:
    python 11_ray_lraspp_roads.py --workers 4
"""
import argparse
import glob
import os
import tempfile

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.models.segmentation import lraspp_mobilenet_v3_large
from torchvision.transforms import functional as TF

import ray
import ray.train
import ray.train.torch
from ray.train import Checkpoint, RunConfig, ScalingConfig, FailureConfig
from ray.train.torch import TorchTrainer

DEVICE = "cuda:0"
NUM_CLASSES = 3  # background, road, lane marking
CLASS_WEIGHTS = [0.3, 1.0, 4.0]


class RoadSet(Dataset):
    def __init__(self, root, split, size=(512, 1024), train=True):
        self.imgs = sorted(glob.glob(os.path.join(root, split, "img", "*.jpg")))
        self.size = size
        self.train = train

    def __len__(self):
        return len(self.imgs)

    def __getitem__(self, i):
        img = Image.open(self.imgs[i]).convert("RGB")
        lbl = Image.open(self.imgs[i].replace("/img/", "/lbl/").replace(".jpg", ".png"))
        img = TF.resize(img, self.size)
        lbl = TF.resize(lbl, self.size, interpolation=TF.InterpolationMode.NEAREST)
        if self.train:
            if np.random.rand() < 0.5:
                img, lbl = TF.hflip(img), TF.hflip(lbl)
            img = TF.adjust_brightness(img, np.random.uniform(0.7, 1.3))
            img = TF.adjust_contrast(img, np.random.uniform(0.7, 1.3))
        x = TF.normalize(TF.to_tensor(img), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        y = torch.from_numpy(np.array(lbl, dtype=np.int64))
        return x, y


def iou_counts(pred, target, n=NUM_CLASSES):
    inter = torch.zeros(n, device=pred.device)
    union = torch.zeros(n, device=pred.device)
    for c in range(n):
        p, t = pred == c, target == c
        inter[c] = (p & t).sum()
        union[c] = (p | t).sum()
    return inter, union


def train_func(config):
    ctx = ray.train.get_context()
    train_ds = RoadSet(config["root"], "train", train=True)
    val_ds = RoadSet(config["root"], "val", train=False)
    train_dl = DataLoader(train_ds, batch_size=config["bs"], shuffle=True, num_workers=6, drop_last=True,
                          pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=8, num_workers=4)
    train_dl = ray.train.torch.prepare_data_loader(train_dl, move_to_device=False)
    val_dl = ray.train.torch.prepare_data_loader(val_dl, move_to_device=False)

    model = lraspp_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=NUM_CLASSES)
    if config.get("backbone"):
        model.backbone.load_state_dict(torch.load(config["backbone"], map_location="cpu"), strict=False)
    model = ray.train.torch.prepare_model(model)

    weights = torch.tensor(CLASS_WEIGHTS, device=DEVICE)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9, weight_decay=4e-5)
    total_iters = config["epochs"] * len(train_dl)
    scheduler = torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=total_iters, power=0.9)

    for epoch in range(config["epochs"]):
        if ctx.get_world_size() > 1:
            train_dl.sampler.set_epoch(epoch)
        model.train()
        total_loss, n = 0.0, 0
        for x, y in train_dl:
            x, y = x.to(DEVICE, non_blocking=True), y.to(DEVICE, non_blocking=True)
            out = model(x)["out"]
            loss = F.cross_entropy(out, y, weight=weights, ignore_index=255)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            total_loss += loss.item()
            n += 1

        model.eval()
        inter = torch.zeros(NUM_CLASSES, device=DEVICE)
        union = torch.zeros(NUM_CLASSES, device=DEVICE)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(DEVICE), y.to(DEVICE)
                pred = model(x)["out"].argmax(1)
                i, u = iou_counts(pred, y)
                inter += i
                union += u
        if ctx.get_world_size() > 1:
            torch.distributed.all_reduce(inter)
            torch.distributed.all_reduce(union)
        iou = (inter / union.clamp(min=1)).tolist()
        metrics = {"epoch": epoch, "loss": total_loss / max(n, 1), "miou": float(np.mean(iou)),
                   "iou_road": iou[1], "iou_lane": iou[2]}

        with tempfile.TemporaryDirectory() as tmp:
            ckpt = None
            if ctx.get_world_rank() == 0 and (epoch + 1) % config["ckpt_every"] == 0:
                sd = model.module.state_dict() if hasattr(model, "module") else model.state_dict()
                torch.save({"model": sd, "epoch": epoch}, os.path.join(tmp, "model.pt"))
                ckpt = Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=ckpt)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/roads")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--backbone", default="")
    ap.add_argument("--ckpt-every", type=int, default=5)
    args = ap.parse_args()

    ray.init(ignore_reinit_error=True)
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"root": args.root, "bs": args.bs, "epochs": args.epochs, "lr": args.lr,
                           "backbone": args.backbone, "ckpt_every": args.ckpt_every},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=True),
        run_config=RunConfig(name="lraspp_roads", storage_path=os.path.expanduser("~/ray_results"),
                             failure_config=FailureConfig(max_failures=1)),
    )
    res = trainer.fit()
    print(res.metrics)


if __name__ == "__main__":
    main()
