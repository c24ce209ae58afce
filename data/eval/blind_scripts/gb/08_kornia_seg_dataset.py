"""DeepLabV3-ResNet50 semantic segmentation, joint image/mask augmentation with kornia.

torchrun --nproc_per_node=8 08_kornia_seg_dataset.py --root /data/cityscapes --epochs 200
"""
import argparse
import glob
import os
import time

import kornia.augmentation as K
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.segmentation import deeplabv3_resnet50

NUM_CLASSES = 19
IGNORE = 255
MEAN = torch.tensor([0.485, 0.456, 0.406])
STD = torch.tensor([0.229, 0.224, 0.225])


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8, help="per GPU")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--crop", type=int, default=768)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--save", default="/shared/seg/deeplab_r50")
    return p.parse_args()


class CityscapesFine(Dataset):
    """Reads leftImg8bit / gtFine trainIds pairs and augments image+mask together on the GPU."""

    def __init__(self, root, split, crop, device, train=True):
        self.images = sorted(glob.glob(os.path.join(root, "leftImg8bit", split, "*", "*_leftImg8bit.png")))
        self.masks = [p.replace("leftImg8bit", "gtFine").replace(".png", "_labelTrainIds.png")
                      .replace("gtFine_gtFine", "gtFine") for p in self.images]
        self.train = train
        self.device = device
        self.aug = K.AugmentationSequential(
            K.RandomResizedCrop((crop, crop), scale=(0.25, 1.0), ratio=(1.5, 2.5)),
            K.RandomHorizontalFlip(),
            K.ColorJitter(0.25, 0.25, 0.25, 0.0, p=0.5),
            data_keys=["input", "mask"],
        ).to(device)
        self.norm = K.Normalize(MEAN, STD).to(device)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, idx):
        img = torch.from_numpy(np.array(Image.open(self.images[idx]).convert("RGB"))).permute(2, 0, 1)
        mask = torch.from_numpy(np.array(Image.open(self.masks[idx]), dtype=np.int64))
        img = img.to(self.device, non_blocking=True).float().div(255).unsqueeze(0)
        mask = mask.to(self.device, non_blocking=True)[None, None].float()
        if self.train:
            img, mask = self.aug(img, mask)
        img = self.norm(img)
        return img[0], mask[0, 0].long()


def poly_lr(optimizer, base_lr, it, max_it, power=0.9):
    lr = base_lr * (1 - it / max_it) ** power
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_mult", 1.0)
    return lr


@torch.no_grad()
def confusion(pred, target, n):
    k = target != IGNORE
    return torch.bincount(n * target[k] + pred[k], minlength=n * n).view(n, n)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    train_set = CityscapesFine(args.root, "train", args.crop, device, train=True)
    val_set = CityscapesFine(args.root, "val", args.crop, device, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_part = torch.utils.data.Subset(val_set, range(rank, len(val_set), world))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_part, batch_size=1, shuffle=False, num_workers=args.workers)

    model = deeplabv3_resnet50(weights=None, weights_backbone="IMAGENET1K_V2",
                               num_classes=NUM_CLASSES, aux_loss=True)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    params = [
        {"params": model.module.backbone.parameters(), "lr_mult": 1.0},
        {"params": list(model.module.classifier.parameters()) + list(model.module.aux_classifier.parameters()),
         "lr_mult": 10.0},
    ]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-4)
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE)
    max_it = args.epochs * len(train_loader)

    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
    it, best_miou = 0, 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for img, mask in train_loader:
            lr = poly_lr(optimizer, args.lr, it, max_it)
            out = model(img)
            loss = criterion(out["out"], mask) + 0.4 * criterion(out["aux"], mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            it += 1
            if rank == 0 and it % 50 == 0:
                print(f"ep {epoch} it {it}/{max_it} loss {loss.item():.3f} lr {lr:.5f}")

        if (epoch + 1) % 10 == 0 or epoch == args.epochs - 1:
            model.eval()
            hist = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long, device=device)
            with torch.no_grad():
                for img, mask in val_loader:
                    logits = model.module(img)["out"]
                    logits = F.interpolate(logits, size=mask.shape[-2:], mode="bilinear", align_corners=False)
                    hist += confusion(logits.argmax(1).flatten(), mask.flatten(), NUM_CLASSES)
            dist.all_reduce(hist)
            iou = hist.diag().float() / (hist.sum(0) + hist.sum(1) - hist.diag()).clamp(min=1).float()
            miou = iou.mean().item() * 100
            if rank == 0:
                print(f"epoch {epoch} mIoU {miou:.2f} ({time.time() - t0:.0f}s)")
                if miou > best_miou:
                    best_miou = miou
                    torch.save(model.module.state_dict(), os.path.join(args.save, "best.pth"))
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch, "it": it}, os.path.join(args.save, "last.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
