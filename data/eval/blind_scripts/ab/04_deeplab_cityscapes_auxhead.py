"""DeepLabV3-ResNet50 on Cityscapes, DDP + SyncBN.

The auxiliary FCN head (on layer3) is only used as deep supervision during the
first --aux-epochs epochs; after that we train on the main output alone.

    torchrun --nproc_per_node=8 --max-restarts=2 04_deeplab_cityscapes_auxhead.py
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import Cityscapes
from torchvision.models.segmentation import deeplabv3_resnet50, DeepLabV3_ResNet50_Weights
from torchvision.transforms import v2 as T
from torchvision import tv_tensors

IGNORE = 255
NUM_CLASSES = 19


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/datasets/cityscapes")
    ap.add_argument("--out", default="/nfs/seg_runs/deeplab_cs")
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--aux-epochs", type=int, default=40)
    ap.add_argument("--aux-weight", type=float, default=0.4)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--crop", type=int, default=768)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--workers", type=int, default=6)
    return ap.parse_args()


class JointTransform:
    def __init__(self, train, crop):
        if train:
            self.t = T.Compose([
                T.RandomResize(min_size=int(crop * 0.5), max_size=int(crop * 2.0)),
                T.RandomCrop(crop, pad_if_needed=True, fill={tv_tensors.Mask: IGNORE, "others": 0}),
                T.RandomHorizontalFlip(),
                T.ColorJitter(0.3, 0.3, 0.3),
                T.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True),
                T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
            ])
        else:
            self.t = T.Compose([
                T.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True),
                T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
            ])

    def __call__(self, img, target):
        img = tv_tensors.Image(T.functional.pil_to_tensor(img))
        mask = tv_tensors.Mask(T.functional.pil_to_tensor(target).squeeze(0).long())
        img, mask = self.t(img, mask)
        return img, mask


def make_train_id_lut():
    from torchvision.datasets.cityscapes import Cityscapes as CS
    lut = torch.full((256,), IGNORE, dtype=torch.long)
    for c in CS.classes:
        if 0 <= c.train_id < NUM_CLASSES:
            lut[c.id] = c.train_id
    return lut


def poly_lr(optimizer, base_lr, it, max_it, power=0.9):
    lr = base_lr * (1 - it / max_it) ** power
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_mult", 1.0)
    return lr


@torch.no_grad()
def evaluate(model, loader, lut, device):
    model.eval()
    hist = torch.zeros(NUM_CLASSES, NUM_CLASSES, device=device, dtype=torch.long)
    for img, mask in loader:
        img = img.to(device, non_blocking=True)
        mask = lut[mask].to(device, non_blocking=True)
        out = model.module(img)["out"]
        pred = out.argmax(1)
        valid = mask != IGNORE
        hist += torch.bincount(mask[valid] * NUM_CLASSES + pred[valid],
                               minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES)
    dist.all_reduce(hist)
    iou = hist.diag().float() / (hist.sum(0) + hist.sum(1) - hist.diag()).clamp(min=1).float()
    model.train()
    return iou.mean().item(), iou.cpu().tolist()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.backends.cudnn.benchmark = True

    train_ds = Cityscapes(args.root, split="train", mode="fine", target_type="semantic",
                          transforms=JointTransform(True, args.crop))
    val_ds = Cityscapes(args.root, split="val", mode="fine", target_type="semantic",
                        transforms=JointTransform(False, args.crop))
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True,
                          persistent_workers=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                        batch_size=1, num_workers=args.workers, pin_memory=True)
    lut = make_train_id_lut()

    model = deeplabv3_resnet50(weights=None, weights_backbone="IMAGENET1K_V2",
                               num_classes=NUM_CLASSES, aux_loss=True)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    backbone = [p for n, p in model.named_parameters() if "backbone" in n]
    heads = [p for n, p in model.named_parameters() if "backbone" not in n]
    optimizer = torch.optim.SGD([
        {"params": backbone, "lr_mult": 1.0},
        {"params": heads, "lr_mult": 10.0},
    ], lr=args.lr, momentum=0.9, weight_decay=1e-4, nesterov=False)
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE)

    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, "last.pth")
    start_epoch, best_miou = 0, 0.0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optim"])
        start_epoch, best_miou = ck["epoch"] + 1, ck["best_miou"]
        if rank == 0:
            print(f"resume from epoch {start_epoch}, best mIoU {best_miou:.4f}")

    max_it = args.epochs * len(train_dl)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        use_aux = epoch < args.aux_epochs
        t0 = time.time()
        for i, (img, mask) in enumerate(train_dl):
            it = epoch * len(train_dl) + i
            lr = poly_lr(optimizer, args.lr, it, max_it)
            img = img.to(device, non_blocking=True)
            mask = lut[mask].to(device, non_blocking=True)

            with torch.autocast("cuda", dtype=torch.bfloat16):
                outputs = model(img)
                loss = criterion(outputs["out"].float(), mask)
                if use_aux:
                    loss = loss + args.aux_weight * criterion(outputs["aux"].float(), mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

            if rank == 0 and i % 20 == 0:
                print(f"[{epoch}/{args.epochs}] it {i}/{len(train_dl)} loss {loss.item():.4f} "
                      f"lr {lr:.5f} aux={'on' if use_aux else 'off'} "
                      f"{(time.time() - t0) / (i + 1):.2f}s/it", flush=True)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            miou, per_class = evaluate(model, val_dl, lut, device)
            if rank == 0:
                print(f"epoch {epoch} mIoU {miou:.4f}", flush=True)
                if miou > best_miou:
                    best_miou = miou
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optim": optimizer.state_dict(),
                        "epoch": epoch, "best_miou": best_miou}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
