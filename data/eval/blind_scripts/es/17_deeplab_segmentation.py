"""DeepLabV3-ResNet101 for road-scene segmentation (19 classes, Cityscapes-style label ids).

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 17_deeplab_segmentation.py \
        --root /data/roadscenes --crop 768 --batch-size 2
"""
import argparse
import glob
import os
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.models.segmentation import DeepLabV3_ResNet101_Weights, deeplabv3_resnet101

NUM_CLASSES = 19
IGNORE = 255
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


class RoadScenes(Dataset):
    def __init__(self, image_files, root, crop, train):
        self.images = image_files
        self.root, self.crop, self.train = root, crop, train

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img_path = self.images[i]
        mask_path = img_path.replace("/images/", "/labels/").replace(".jpg", "_trainIds.png")
        img = Image.open(img_path).convert("RGB")
        mask = Image.open(mask_path)
        if self.train:
            scale = random.uniform(0.5, 2.0)
            w, h = img.size
            img = img.resize((int(w * scale), int(h * scale)), Image.BILINEAR)
            mask = mask.resize((int(w * scale), int(h * scale)), Image.NEAREST)
            if random.random() < 0.5:
                img, mask = img.transpose(Image.FLIP_LEFT_RIGHT), mask.transpose(Image.FLIP_LEFT_RIGHT)
        img = (np.asarray(img, dtype=np.float32) / 255.0 - MEAN) / STD
        mask = np.asarray(mask, dtype=np.int64)
        if self.train:
            img, mask = self._random_crop(img, mask)
        return torch.from_numpy(img.transpose(2, 0, 1).copy()), torch.from_numpy(mask.copy())

    def _random_crop(self, img, mask):
        h, w = mask.shape
        ph, pw = max(self.crop - h, 0), max(self.crop - w, 0)
        if ph or pw:
            img = np.pad(img, ((0, ph), (0, pw), (0, 0)))
            mask = np.pad(mask, ((0, ph), (0, pw)), constant_values=IGNORE)
            h, w = mask.shape
        y, x = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
        return img[y:y + self.crop, x:x + self.crop], mask[y:y + self.crop, x:x + self.crop]


def build_model():
    net = deeplabv3_resnet101(weights=DeepLabV3_ResNet101_Weights.COCO_WITH_VOC_LABELS_V1, aux_loss=True)
    net.classifier[4] = nn.Conv2d(256, NUM_CLASSES, 1)
    net.aux_classifier[4] = nn.Conv2d(256, NUM_CLASSES, 1)
    return net


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="runs/deeplab_road")
    ap.add_argument("--crop", type=int, default=768)
    ap.add_argument("--batch-size", type=int, default=2, help="per GPU")
    ap.add_argument("--iters", type=int, default=60000)
    ap.add_argument("--aux-weight", type=float, default=0.4)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--val-every", type=int, default=2000)
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--init-from", default=None, help="weights file saved by an earlier run")
    ap.add_argument("--seed", type=int, default=123)
    return ap.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator()
    # different crops/flips on each GPU; the split below uses its own generator
    set_seed(args.seed, device_specific=True)

    files = sorted(glob.glob(os.path.join(args.root, "images", "*", "*.jpg")))
    perm = torch.randperm(len(files), generator=torch.Generator().manual_seed(args.seed)).tolist()
    n_val = int(len(files) * args.val_fraction)
    val_files = [files[i] for i in perm[:n_val]]
    train_files = [files[i] for i in perm[n_val:]]
    train_ds = RoadScenes(train_files, args.root, args.crop, train=True)
    val_ds = RoadScenes(val_files, args.root, args.crop, train=False)

    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=6,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=1, shuffle=False, num_workers=4)

    model = build_model()
    if args.init_from:
        accelerator.wait_for_everyone()
        state = torch.load(args.init_from, map_location="cpu")
        model.load_state_dict(state)
    # two crops per GPU: BatchNorm statistics have to be computed over the whole global batch
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)

    backbone_params = list(model.backbone.parameters())
    head_params = list(model.classifier.parameters()) + list(model.aux_classifier.parameters())
    optimizer = torch.optim.SGD([{"params": backbone_params, "lr": args.lr},
                                 {"params": head_params, "lr": args.lr * 10}],
                                lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=args.iters, power=0.9)
    model, optimizer, train_loader, val_loader = accelerator.prepare(model, optimizer, train_loader, val_loader)
    accelerator.register_for_checkpointing(scheduler)
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE)

    if accelerator.is_main_process:
        os.makedirs(args.out, exist_ok=True)
    accelerator.print(f"train {len(train_ds)} val {len(val_ds)} global batch "
                      f"{args.batch_size * accelerator.num_processes}")

    it, best_miou = 0, 0.0
    train_iter = iter(train_loader)
    model.train()
    while it < args.iters:
        try:
            images, masks = next(train_iter)
        except StopIteration:
            train_iter = iter(train_loader)
            images, masks = next(train_iter)
        outputs = model(images)
        loss = criterion(outputs["out"], masks) + args.aux_weight * criterion(outputs["aux"], masks)
        optimizer.zero_grad(set_to_none=True)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        it += 1
        if it % 50 == 0:
            accelerator.print(f"iter {it}/{args.iters} loss "
                              f"{accelerator.reduce(loss.detach(), reduction='mean').item():.4f}")

        if it % args.val_every == 0 or it == args.iters:
            model.eval()
            confusion = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long, device=accelerator.device)
            with torch.no_grad():
                for images, masks in val_loader:
                    preds = model(images)["out"].argmax(1)
                    valid = masks != IGNORE
                    idx = masks[valid] * NUM_CLASSES + preds[valid]
                    # one confusion row per image, so images of any size can be gathered
                    per_image = torch.bincount(idx, minlength=NUM_CLASSES ** 2).unsqueeze(0)
                    per_image = accelerator.gather_for_metrics(per_image)
                    confusion += per_image.sum(0).view(NUM_CLASSES, NUM_CLASSES)
            iou = confusion.diag().float() / (confusion.sum(0) + confusion.sum(1) - confusion.diag()).clamp(min=1)
            miou = iou.mean().item()
            accelerator.print(f"iter {it}: mIoU {miou:.4f}")
            accelerator.wait_for_everyone()
            if miou > best_miou:
                best_miou = miou
                accelerator.save(accelerator.unwrap_model(model).state_dict(), os.path.join(args.out, "best.pth"))
            accelerator.save_state(os.path.join(args.out, "last"))
            model.train()

    accelerator.print(f"best mIoU {best_miou:.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
