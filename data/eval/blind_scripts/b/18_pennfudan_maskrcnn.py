"""
Fine-tune torchvision Mask R-CNN on the Penn-Fudan pedestrian dataset, multi-GPU.

    torchrun --nproc_per_node=4 18_pennfudan_maskrcnn.py --root data/PennFudanPed --epochs 20
"""
import argparse
import math
import os
import sys
import time
import zipfile
import urllib.request

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.detection import maskrcnn_resnet50_fpn_v2, MaskRCNN_ResNet50_FPN_V2_Weights
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.models.detection.mask_rcnn import MaskRCNNPredictor
from torchvision.transforms import functional as TF

URL = "https://www.cis.upenn.edu/~jshi/ped_html/PennFudanPed.zip"


class PennFudan(Dataset):
    def __init__(self, root, train=True):
        self.root, self.train = root, train
        self.imgs = sorted(os.listdir(os.path.join(root, "PNGImages")))
        self.masks = sorted(os.listdir(os.path.join(root, "PedMasks")))

    def __len__(self):
        return len(self.imgs)

    def __getitem__(self, idx):
        img = Image.open(os.path.join(self.root, "PNGImages", self.imgs[idx])).convert("RGB")
        mask = np.array(Image.open(os.path.join(self.root, "PedMasks", self.masks[idx])))
        obj_ids = np.unique(mask)[1:]
        masks = torch.as_tensor(mask == obj_ids[:, None, None], dtype=torch.uint8)
        boxes = []
        for m in masks:
            pos = torch.nonzero(m)
            boxes.append([pos[:, 1].min(), pos[:, 0].min(), pos[:, 1].max(), pos[:, 0].max()])
        boxes = torch.as_tensor(boxes, dtype=torch.float32)
        target = {
            "boxes": boxes,
            "labels": torch.ones((len(obj_ids),), dtype=torch.int64),
            "masks": masks,
            "image_id": idx,
            "area": (boxes[:, 3] - boxes[:, 1]) * (boxes[:, 2] - boxes[:, 0]),
            "iscrowd": torch.zeros((len(obj_ids),), dtype=torch.int64),
        }
        img = TF.to_tensor(img)
        if self.train and torch.rand(1) < 0.5:
            img = img.flip(-1)
            w = img.shape[-1]
            target["boxes"][:, [0, 2]] = w - target["boxes"][:, [2, 0]]
            target["masks"] = target["masks"].flip(-1)
        return img, target


def collate_fn(batch):
    return tuple(zip(*batch))


def prepare_data(root):
    if not os.path.isdir(root):
        parent = os.path.dirname(os.path.abspath(root))
        os.makedirs(parent, exist_ok=True)
        zpath = os.path.join(parent, "PennFudanPed.zip")
        urllib.request.urlretrieve(URL, zpath)
        with zipfile.ZipFile(zpath) as z:
            z.extractall(parent)


def get_model(num_classes=2):
    model = maskrcnn_resnet50_fpn_v2(weights=MaskRCNN_ResNet50_FPN_V2_Weights.DEFAULT)
    in_features = model.roi_heads.box_predictor.cls_score.in_features
    model.roi_heads.box_predictor = FastRCNNPredictor(in_features, num_classes)
    in_features_mask = model.roi_heads.mask_predictor.conv5_mask.in_channels
    model.roi_heads.mask_predictor = MaskRCNNPredictor(in_features_mask, 256, num_classes)
    return model


def reduce_dict(d, world_size):
    names = sorted(d.keys())
    values = torch.stack([d[k].detach() for k in names])
    dist.all_reduce(values)
    values /= world_size
    return dict(zip(names, values))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="data/PennFudanPed")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=2, help="images per GPU")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--output-dir", default="out/maskrcnn")
    parser.add_argument("--print-freq", type=int, default=10)
    args = parser.parse_args()

    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    if rank == 0:
        prepare_data(args.root)
        os.makedirs(args.output_dir, exist_ok=True)
    dist.barrier()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    full = PennFudan(args.root, train=True)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(full), generator=g).tolist()
    train_set = torch.utils.data.Subset(full, perm[:-50])
    val_set = torch.utils.data.Subset(PennFudan(args.root, train=False), perm[-50:])
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, collate_fn=collate_fn)
    val_loader = DataLoader(val_set, batch_size=1, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=2, collate_fn=collate_fn)

    model = get_model().to(device)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    params = [p for p in model.parameters() if p.requires_grad]
    # lr 0.02 is for 16 images per step (detectron convention); scale with global batch
    lr = args.lr * args.batch_size * world_size / 16
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[14, 18], gamma=0.1)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (images, targets) in enumerate(train_loader):
            images = [img.to(device) for img in images]
            targets = [{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in t.items()} for t in targets]
            loss_dict = model(images, targets)
            losses = sum(loss_dict.values())
            loss_dict_reduced = reduce_dict(loss_dict, world_size)
            loss_value = sum(loss_dict_reduced.values()).item()
            if not math.isfinite(loss_value):
                print(f"Loss is {loss_value}, stopping training: {loss_dict_reduced}")
                sys.exit(1)
            optimizer.zero_grad()
            losses.backward()
            optimizer.step()
            if rank == 0 and it % args.print_freq == 0:
                pretty = ", ".join(f"{k}={v.item():.3f}" for k, v in loss_dict_reduced.items())
                print(f"epoch {epoch} [{it}/{len(train_loader)}] loss={loss_value:.3f} {pretty}")
        scheduler.step()

        # quick val: mean best-box IoU, summed over ranks
        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for images, targets in val_loader:
                out = model([img.to(device) for img in images])[0]
                gt = targets[0]["boxes"].to(device)
                if len(out["boxes"]):
                    from torchvision.ops import box_iou
                    acc[0] += box_iou(gt, out["boxes"]).max(dim=1).values.mean()
                acc[1] += 1
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch}: val mean IoU {(acc[0] / acc[1]).item():.3f} ({time.time() - t0:.0f}s)")
            torch.save({"model": model.module.state_dict(), "epoch": epoch},
                       os.path.join(args.output_dir, f"model_{epoch}.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
