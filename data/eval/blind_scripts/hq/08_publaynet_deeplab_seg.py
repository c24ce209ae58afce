"""Page layout segmentation on PubLayNet (text / title / list / table / figure) with DeepLabV3-R50.

Masks are rasterised from the COCO polygons on the fly. Pages are resized to 1024 on the long side,
which limits us to 2 pages per GPU on 24 GB cards.

    torchrun --nnodes=1 --nproc_per_node=8 08_publaynet_deeplab_seg.py --root /datasets/publaynet
"""
import argparse
import datetime
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image, ImageDraw
from pycocotools.coco import COCO
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.models import ResNet50_Weights
from torchvision.models.segmentation import deeplabv3_resnet50

CLASSES = ["background", "text", "title", "list", "table", "figure"]
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--long_side", type=int, default=1024)
    ap.add_argument("--batch_size", type=int, default=2, help="pages per GPU")
    ap.add_argument("--iters", type=int, default=80000)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--wd", type=float, default=1e-4)
    ap.add_argument("--val_interval", type=int, default=8000)
    ap.add_argument("--val_pages", type=int, default=2000)
    ap.add_argument("--work_dir", default="work_dirs/deeplab_publaynet")
    ap.add_argument("--workers", type=int, default=6)
    return ap.parse_args()


class PubLayNetSeg(Dataset):
    def __init__(self, root, split, long_side, train, limit=None):
        self.img_dir = os.path.join(root, split)
        self.coco = COCO(os.path.join(root, f"{split}.json"))
        self.ids = sorted(self.coco.getImgIds())
        if limit:
            self.ids = self.ids[:limit]
        self.long_side = long_side
        self.train = train

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        info = self.coco.loadImgs(self.ids[i])[0]
        img = Image.open(os.path.join(self.img_dir, info["file_name"])).convert("RGB")
        mask = Image.new("L", img.size, 0)
        draw = ImageDraw.Draw(mask)
        anns = self.coco.loadAnns(self.coco.getAnnIds(imgIds=info["id"]))
        # large regions first so that titles / list items drawn later stay visible
        for ann in sorted(anns, key=lambda a: -a["area"]):
            for poly in ann["segmentation"]:
                draw.polygon(list(map(float, poly)), fill=ann["category_id"])

        scale = self.long_side / max(img.size)
        if self.train:
            scale *= random.uniform(0.75, 1.25)
        size = (int(img.width * scale), int(img.height * scale))
        img = img.resize(size, Image.BILINEAR)
        mask = mask.resize(size, Image.NEAREST)

        x = (np.asarray(img, dtype=np.float32) / 255.0 - MEAN) / STD
        x = torch.from_numpy(x.transpose(2, 0, 1))
        y = torch.from_numpy(np.asarray(mask, dtype=np.int64))
        # pad/crop to a fixed square so pages batch together
        s = self.long_side
        x = F.pad(x, (0, max(0, s - x.shape[2]), 0, max(0, s - x.shape[1])))[:, :s, :s]
        y = F.pad(y, (0, max(0, s - y.shape[1]), 0, max(0, s - y.shape[0])), value=255)[:s, :s]
        return x, y


@torch.no_grad()
def evaluate(model, loader, device, n_cls):
    model.eval()
    hist = torch.zeros(n_cls, n_cls, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        pred = model(x)["out"].argmax(1)
        valid = y != 255
        hist += torch.bincount(n_cls * y[valid] + pred[valid], minlength=n_cls ** 2).view(n_cls, n_cls)
    dist.all_reduce(hist)
    model.train()
    iou = hist.diag() / (hist.sum(0) + hist.sum(1) - hist.diag()).clamp(min=1)
    return iou.cpu().tolist()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    writer = SummaryWriter(args.work_dir) if rank == 0 else None

    train_set = PubLayNetSeg(args.root, "train", args.long_side, train=True)
    val_set = PubLayNetSeg(args.root, "val", args.long_side, train=False, limit=args.val_pages)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size,
                            sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    model = deeplabv3_resnet50(weights_backbone=ResNet50_Weights.IMAGENET1K_V2,
                               num_classes=len(CLASSES), aux_loss=True)
    model = DDP(model.to(device), device_ids=[local_rank])

    params = [
        {"params": model.module.backbone.parameters(), "lr": args.lr},
        {"params": model.module.classifier.parameters(), "lr": args.lr * 10},
        {"params": model.module.aux_classifier.parameters(), "lr": args.lr * 10},
    ]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: (1 - it / args.iters) ** 0.9)

    it, epoch = 0, 0
    best_miou = 0.0
    while it < args.iters:
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)
            loss = F.cross_entropy(out["out"], y, ignore_index=255) \
                + 0.4 * F.cross_entropy(out["aux"], y, ignore_index=255)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            it += 1
            if rank == 0 and it % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), it)
                writer.add_scalar("train/lr", scheduler.get_last_lr()[0], it)
            if it % args.val_interval == 0 or it == args.iters:
                ious = evaluate(model, val_loader, device, len(CLASSES))
                miou = float(np.mean(ious[1:]))
                if rank == 0:
                    for name, v in zip(CLASSES, ious):
                        writer.add_scalar(f"val/iou_{name}", v, it)
                    writer.add_scalar("val/mIoU", miou, it)
                    print(f"iter {it}: mIoU {miou:.4f} " + " ".join(f"{n}={v:.3f}" for n, v in zip(CLASSES, ious)),
                          flush=True)
                    ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "iter": it}
                    torch.save(ckpt, os.path.join(args.work_dir, "latest.pth"))
                    if miou > best_miou:
                        best_miou = miou
                        torch.save(ckpt, os.path.join(args.work_dir, "best_mIoU.pth"))
                dist.barrier()
            if it >= args.iters:
                break
        epoch += 1

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
