"""DeepLabV3-ResNet50 on Cityscapes (19 classes), multi-GPU.

    torchrun --nproc_per_node=4 train_seg.py --data-root /data/cityscapes --epochs 200 --batch-size 4
"""
import argparse
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.segmentation import deeplabv3_resnet50
from torchvision.models import ResNet50_Weights

IGNORE = 255
# Cityscapes labelIds -> trainIds
ID_TO_TRAINID = {7: 0, 8: 1, 11: 2, 12: 3, 13: 4, 17: 5, 19: 6, 20: 7, 21: 8, 22: 9, 23: 10,
                 24: 11, 25: 12, 26: 13, 27: 14, 28: 15, 31: 16, 32: 17, 33: 18}
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", required=True)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=4, help="images per GPU")
    p.add_argument("--lr", type=float, default=0.01, help="for a total batch of 16")
    p.add_argument("--crop", type=int, default=768)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--work-dir", default="./work_dirs/deeplabv3_r50_cityscapes")
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


class Cityscapes(Dataset):
    def __init__(self, root, split, crop=768, train=True):
        self.train, self.crop = train, crop
        img_dir = os.path.join(root, "leftImg8bit", split)
        self.items = []
        for city in sorted(os.listdir(img_dir)):
            for fn in sorted(os.listdir(os.path.join(img_dir, city))):
                lbl = fn.replace("leftImg8bit.png", "gtFine_labelIds.png")
                self.items.append((os.path.join(img_dir, city, fn),
                                   os.path.join(root, "gtFine", split, city, lbl)))
        self.lut = np.full(256, IGNORE, dtype=np.uint8)
        for k, v in ID_TO_TRAINID.items():
            self.lut[k] = v

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        img = Image.open(self.items[i][0]).convert("RGB")
        lbl = Image.open(self.items[i][1])
        if self.train:
            s = random.uniform(0.5, 2.0)
            w, h = img.size
            nw, nh = int(w * s), int(h * s)
            img, lbl = img.resize((nw, nh), Image.BILINEAR), lbl.resize((nw, nh), Image.NEAREST)
        img = (np.asarray(img, dtype=np.float32) / 255.0 - MEAN) / STD
        lbl = self.lut[np.asarray(lbl)]
        if self.train:
            h, w = lbl.shape
            ph, pw = max(self.crop - h, 0), max(self.crop - w, 0)
            img = np.pad(img, ((0, ph), (0, pw), (0, 0)))
            lbl = np.pad(lbl, ((0, ph), (0, pw)), constant_values=IGNORE)
            y = random.randint(0, lbl.shape[0] - self.crop)
            x = random.randint(0, lbl.shape[1] - self.crop)
            img, lbl = img[y:y + self.crop, x:x + self.crop], lbl[y:y + self.crop, x:x + self.crop]
            if random.random() < 0.5:
                img, lbl = img[:, ::-1], lbl[:, ::-1]
        img = torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1)))
        return img, torch.from_numpy(np.ascontiguousarray(lbl)).long()


def poly_lr(optimizer, base_lr, cur_iter, max_iter, power=0.9):
    lr = base_lr * (1 - cur_iter / max_iter) ** power
    for i, g in enumerate(optimizer.param_groups):
        g["lr"] = lr * (10 if i == 1 else 1)


@torch.no_grad()
def evaluate(model, loader, device, num_classes=19):
    model.eval()
    hist = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
    for img, lbl in loader:
        img, lbl = img.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
        out = model(img)["out"]
        pred = out.argmax(1)
        k = lbl != IGNORE
        hist += torch.bincount(num_classes * lbl[k] + pred[k], minlength=num_classes ** 2).view(num_classes, num_classes)
    dist.all_reduce(hist)
    iou = hist.diag().float() / (hist.sum(0) + hist.sum(1) - hist.diag()).float().clamp(min=1)
    return iou.mean().item(), iou.cpu().numpy()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO if rank == 0 else logging.ERROR)
    log = logging.getLogger(__name__)
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    train_set = Cityscapes(args.data_root, "train", args.crop, train=True)
    val_set = Cityscapes(args.data_root, "val", train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    # 500 val images: 125 per GPU with 4 GPUs, no padding
    val_loader = DataLoader(val_set, batch_size=1, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=2)

    model = deeplabv3_resnet50(weights=None, weights_backbone=ResNet50_Weights.IMAGENET1K_V1,
                               num_classes=19, aux_loss=True)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[args.local_rank])

    base_lr = args.lr * args.batch_size * world_size / 16
    backbone = [p for n, p in model.module.named_parameters() if n.startswith("backbone")]
    heads = [p for n, p in model.module.named_parameters() if not n.startswith("backbone")]
    optimizer = torch.optim.SGD([{"params": backbone}, {"params": heads}], lr=base_lr,
                                momentum=0.9, weight_decay=1e-4)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE)

    max_iter = args.epochs * len(train_loader)
    cur_iter, best_miou = 0, 0.0
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for img, lbl in train_loader:
            img, lbl = img.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
            poly_lr(optimizer, base_lr, cur_iter, max_iter)
            with torch.autocast("cuda", enabled=args.amp):
                out = model(img)
                loss = criterion(out["out"], lbl) + 0.4 * criterion(out["aux"], lbl)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
            cur_iter += 1
        dist.all_reduce(running)
        log.info(f"epoch {epoch} loss {running[0] / running[1]:.4f} time {time.time() - t0:.0f}s")

        if (epoch + 1) % args.eval_interval == 0 or epoch + 1 == args.epochs:
            miou, ious = evaluate(model, val_loader, device)
            log.info(f"epoch {epoch} mIoU {miou:.4f}")
            if rank == 0:
                state = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save(state, os.path.join(args.work_dir, "latest.pth"))
                if miou > best_miou:
                    best_miou = miou
                    torch.save(state, os.path.join(args.work_dir, "best.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
