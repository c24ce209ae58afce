"""DeepLabV3-ResNet50 semantic segmentation with iteration-based validation (mIoU).

The best model by validation mIoU is kept and evaluated on the test split at the end.

    torchrun --nproc_per_node=4 07_seg_deeplab_miou.py --data /data/cityscapes_fine --iters 40000
"""
import argparse
import glob
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.segmentation import deeplabv3_resnet50
import torchvision.transforms.functional as TF

IGNORE = 255
NUM_CLASSES = 19


class SegFolder(Dataset):
    """<root>/<split>/images/*.png with masks in <root>/<split>/labels/*.png (train ids)."""

    def __init__(self, root, split, crop=None):
        self.images = sorted(glob.glob(os.path.join(root, split, "images", "*.png")))
        self.labels = [p.replace("/images/", "/labels/") for p in self.images]
        self.crop = crop
        self.train = split == "train"

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = Image.open(self.images[i]).convert("RGB")
        mask = Image.open(self.labels[i])
        if self.train:
            scale = random.uniform(0.5, 2.0)
            w, h = img.size
            size = (int(h * scale), int(w * scale))
            img = TF.resize(img, size, interpolation=TF.InterpolationMode.BILINEAR)
            mask = TF.resize(mask, size, interpolation=TF.InterpolationMode.NEAREST)
            pad_h, pad_w = max(self.crop - size[0], 0), max(self.crop - size[1], 0)
            img = TF.pad(img, [0, 0, pad_w, pad_h], fill=0)
            mask = TF.pad(mask, [0, 0, pad_w, pad_h], fill=IGNORE)
            top = random.randint(0, img.size[1] - self.crop)
            left = random.randint(0, img.size[0] - self.crop)
            img = TF.crop(img, top, left, self.crop, self.crop)
            mask = TF.crop(mask, top, left, self.crop, self.crop)
            if random.random() < 0.5:
                img, mask = TF.hflip(img), TF.hflip(mask)
        img = TF.normalize(TF.to_tensor(img), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        return img, torch.from_numpy(np.array(mask, dtype=np.int64))


def confusion(pred, target, n):
    k = target != IGNORE
    return torch.bincount(n * target[k] + pred[k], minlength=n * n).reshape(n, n)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    hist = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.int64, device=device)
    for img, mask in loader:
        img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
        out = model(img)["out"]
        hist += confusion(out.argmax(1).flatten(), mask.flatten(), NUM_CLASSES)
    dist.all_reduce(hist)
    iou = hist.diag().float() / (hist.sum(0) + hist.sum(1) - hist.diag()).clamp(min=1).float()
    model.train()
    return iou.mean().item(), iou.cpu().tolist()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--work-dir", default="work_dirs/deeplabv3_r50")
    parser.add_argument("--iters", type=int, default=40000)
    parser.add_argument("--val-interval", type=int, default=2000)
    parser.add_argument("--patience", type=int, default=6, help="validations without mIoU gain")
    parser.add_argument("--batch-per-gpu", type=int, default=4)
    parser.add_argument("--crop", type=int, default=768)
    parser.add_argument("--lr", type=float, default=0.01, help="for a total batch of 16 (4 GPUs x 4)")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1234 + rank)
    torch.manual_seed(1234)

    train_set = SegFolder(args.data, "train", crop=args.crop)
    val_set = SegFolder(args.data, "val")
    test_set = SegFolder(args.data, "test")
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_per_gpu, sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True)

    def shard(ds):
        idx = list(range(rank, len(ds), world))
        return DataLoader(torch.utils.data.Subset(ds, idx), batch_size=1, num_workers=4, pin_memory=True)

    val_loader, test_loader = shard(val_set), shard(test_set)

    net = deeplabv3_resnet50(weights=None, weights_backbone="IMAGENET1K_V1", num_classes=NUM_CLASSES,
                             aux_loss=True)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])

    params = [
        {"params": [p for n, p in net.named_parameters() if n.startswith("backbone")], "lr": args.lr},
        {"params": [p for n, p in net.named_parameters() if not n.startswith("backbone")], "lr": args.lr * 10},
    ]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-4)
    poly = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: (1 - it / args.iters) ** 0.9)
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE)

    best_path = os.path.join(args.work_dir, "best_miou.pth")
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
    best_miou, stale, it, epoch = 0.0, 0, 0, 0
    tic = time.time()
    while it < args.iters:
        train_sampler.set_epoch(epoch)
        for img, mask in train_loader:
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            out = model(img)
            loss = criterion(out["out"], mask) + 0.4 * criterion(out["aux"], mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            poly.step()
            it += 1
            if rank == 0 and it % 50 == 0:
                print(f"iter {it}/{args.iters} loss {loss.item():.4f} "
                      f"lr {optimizer.param_groups[0]['lr']:.5f} {time.time() - tic:.0f}s", flush=True)

            if it % args.val_interval == 0 or it == args.iters:
                miou, ious = evaluate(model.module, val_loader, device)
                improved = miou > best_miou
                if improved:
                    best_miou, stale = miou, 0
                    if rank == 0:
                        torch.save({"iter": it, "model": model.module.state_dict(), "miou": miou,
                                    "per_class_iou": ious}, best_path)
                else:
                    stale += 1
                if rank == 0:
                    print(f"[val] iter {it} mIoU {miou:.4f} (best {best_miou:.4f}){' *' if improved else ''}",
                          flush=True)
            if it >= args.iters or stale >= args.patience:
                break
        if stale >= args.patience:
            if rank == 0:
                print(f"mIoU has not improved for {args.patience} validations, stopping at iter {it}")
            break
        epoch += 1

    dist.barrier()
    ckpt = torch.load(best_path)
    model.module.load_state_dict(ckpt["model"])
    test_miou, test_ious = evaluate(model.module, test_loader, device)
    if rank == 0:
        print(f"[test] checkpoint from iter {ckpt['iter']} (val mIoU {ckpt['miou']:.4f}): "
              f"test mIoU {test_miou:.4f}")
        for c, v in enumerate(test_ious):
            print(f"  class {c:2d}: {v:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
