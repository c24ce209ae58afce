#!/usr/bin/env python3
"""
DeepLabV3-ResNet50 on Pascal VOC 2012 (train / val), two home boxes.

  box-a 192.168.1.40  RTX 4080 16GB  (master)
  box-b 192.168.1.41  RTX 3080 10GB

Only 6 crops fit on the 3080, so BN is synchronised across both boxes.
The auxiliary FCN head on layer3 is only used for the first --aux-epochs
epochs, after that it sits idle (hence find_unused_parameters).
Runs / checkpoints live on the NAS share, mounted at /mnt/nas on both boxes.

  torchrun --nnodes=2 --nproc_per_node=1 --node_rank={0,1} \
      --master_addr=192.168.1.40 --master_port=29560 train_voc.py
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import VOCSegmentation
from torchvision.models import ResNet50_Weights
from torchvision.models.segmentation import deeplabv3_resnet50
import torchvision.transforms.functional as TF

NUM_CLASSES = 21
IGNORE = 255
MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]


class TrainTransform:
    def __init__(self, crop=384, scale=(0.5, 2.0)):
        self.crop = crop
        self.scale = scale

    def __call__(self, img, mask):
        s = random.uniform(*self.scale)
        w, h = img.size
        nw, nh = int(w * s), int(h * s)
        img = img.resize((nw, nh), Image.BILINEAR)
        mask = mask.resize((nw, nh), Image.NEAREST)
        pad_w, pad_h = max(self.crop - nw, 0), max(self.crop - nh, 0)
        if pad_w or pad_h:
            img = TF.pad(img, [0, 0, pad_w, pad_h], fill=0)
            mask = TF.pad(mask, [0, 0, pad_w, pad_h], fill=IGNORE)
        w, h = img.size
        x0, y0 = random.randint(0, w - self.crop), random.randint(0, h - self.crop)
        img = img.crop((x0, y0, x0 + self.crop, y0 + self.crop))
        mask = mask.crop((x0, y0, x0 + self.crop, y0 + self.crop))
        if random.random() < 0.5:
            img, mask = TF.hflip(img), TF.hflip(mask)
        img = TF.normalize(TF.to_tensor(img), MEAN, STD)
        return img, torch.as_tensor(np.array(mask), dtype=torch.long)


class EvalTransform:
    def __call__(self, img, mask):
        img = TF.normalize(TF.to_tensor(img), MEAN, STD)
        return img, torch.as_tensor(np.array(mask), dtype=torch.long)


class SegNet(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        base = deeplabv3_resnet50(weights=None, weights_backbone=ResNet50_Weights.IMAGENET1K_V2,
                                  num_classes=num_classes, aux_loss=True)
        self.backbone = base.backbone
        self.head = base.classifier
        self.aux_head = base.aux_classifier

    def forward(self, x, use_aux=False):
        size = x.shape[-2:]
        feats = self.backbone(x)
        out = F.interpolate(self.head(feats["out"]), size=size, mode="bilinear", align_corners=False)
        aux = None
        if use_aux:
            aux = F.interpolate(self.aux_head(feats["aux"]), size=size, mode="bilinear",
                                align_corners=False)
        return out, aux


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--voc-root", default=os.path.expanduser("~/data/voc"))
    p.add_argument("--run-dir", default="/mnt/nas/runs/voc_deeplab")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--aux-epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=6, help="per GPU")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


def confusion(pred, target, n):
    k = target != IGNORE
    return torch.bincount(n * target[k] + pred[k], minlength=n * n).reshape(n, n)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    hist = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long, device=device)
    for img, mask in loader:
        img, mask = img.to(device), mask.to(device)
        out, _ = model(img)
        hist += confusion(out.argmax(1).flatten(), mask.flatten(), NUM_CLASSES)
    dist.all_reduce(hist)
    iou = hist.diag().float() / (hist.sum(0) + hist.sum(1) - hist.diag()).float().clamp(min=1)
    return iou.mean().item(), (hist.diag().sum().float() / hist.sum().float()).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1000 + rank)
    torch.manual_seed(1000 + rank)

    train_set = VOCSegmentation(args.voc_root, year="2012", image_set="train", transforms=TrainTransform())
    val_set = VOCSegmentation(args.voc_root, year="2012", image_set="val", transforms=EvalTransform())
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    # full-size images of different shapes -> batch 1; strided split so no image is counted twice
    val_part = Subset(val_set, list(range(rank, len(val_set), world)))
    val_loader = DataLoader(val_part, batch_size=1, num_workers=2, pin_memory=True)

    model = SegNet(NUM_CLASSES).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    backbone = [p for n, p in model.module.named_parameters() if n.startswith("backbone.")]
    heads = [p for n, p in model.module.named_parameters() if not n.startswith("backbone.")]
    opt = torch.optim.SGD([{"params": backbone, "lr": args.lr},
                           {"params": heads, "lr": args.lr * 10}],
                          momentum=0.9, weight_decay=1e-4)
    total_iters = args.epochs * len(train_loader)
    base_lrs = [args.lr, args.lr * 10]

    start_epoch, best_miou = 0, 0.0
    ckpt_path = os.path.join(args.run_dir, "last.pth")
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start_epoch, best_miou = ckpt["epoch"] + 1, ckpt["best_miou"]
        if rank == 0:
            print(f"resumed from epoch {ckpt['epoch']}")
    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)

    it = start_epoch * len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        use_aux = epoch < args.aux_epochs
        t0 = time.time()
        loss_sum = torch.zeros(1, device=device)
        for img, mask in train_loader:
            img = img.to(device, non_blocking=True)
            mask = mask.to(device, non_blocking=True)
            factor = (1 - it / total_iters) ** 0.9
            for g, base in zip(opt.param_groups, base_lrs):
                g["lr"] = base * factor

            out, aux = model(img, use_aux=use_aux)
            loss = F.cross_entropy(out, mask, ignore_index=IGNORE)
            if aux is not None:
                loss = loss + 0.4 * F.cross_entropy(aux, mask, ignore_index=IGNORE)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += loss.detach()
            it += 1

        dist.all_reduce(loss_sum)
        mean_loss = loss_sum.item() / (len(train_loader) * world)
        # plain module for eval: BN uses running stats, no DDP hooks needed
        miou, pix_acc = evaluate(model.module, val_loader, device)

        if rank == 0:
            print(f"epoch {epoch:3d} loss {mean_loss:.4f} mIoU {miou:.4f} pixAcc {pix_acc:.4f} "
                  f"aux={use_aux} {time.time() - t0:.0f}s", flush=True)
            best_miou = max(best_miou, miou)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                     "epoch": epoch, "best_miou": best_miou}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if miou >= best_miou:
                torch.save(model.module.state_dict(), os.path.join(args.run_dir, "best_model.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
