"""DeepLabV3+ (ResNet-101) on Cityscapes fine, 768x768 crops, sliding-window eval.

    torchrun --nnodes=1 --nproc_per_node=8 02_cityscapes_deeplabv3plus.py \
        --data-root /datasets/cityscapes --work-dir work_dirs/dlv3p_r101_cs
"""
import argparse
import glob
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms.functional as TF
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import resnet101
from torchvision.models._utils import IntermediateLayerGetter
from torchvision.models.segmentation.deeplabv3 import ASPP

NUM_CLASSES = 19
IGNORE = 255
MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", required=True)
    p.add_argument("--work-dir", required=True)
    p.add_argument("--pretrained", default="pretrained/resnet101_v1c.pth")
    p.add_argument("--crop", type=int, default=768)
    p.add_argument("--batch-size", type=int, default=2, help="per GPU")
    p.add_argument("--base-lr", type=float, default=0.01, help="for a total batch of 16")
    p.add_argument("--iters", type=int, default=80000)
    p.add_argument("--eval-every", type=int, default=8000)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--resume", default="")
    return p.parse_args()


class Cityscapes(Dataset):
    def __init__(self, files, crop=768, train=True):
        self.files = files
        self.crop = crop
        self.train = train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img_path, lbl_path = self.files[i]
        img = Image.open(img_path).convert("RGB")
        lbl = Image.open(lbl_path)
        if self.train:
            s = random.uniform(0.5, 2.0)
            w, h = img.size
            size = (int(w * s), int(h * s))
            img, lbl = img.resize(size, Image.BILINEAR), lbl.resize(size, Image.NEAREST)
            pw, ph = max(self.crop - size[0], 0), max(self.crop - size[1], 0)
            img = TF.pad(img, [0, 0, pw, ph], fill=0)
            lbl = TF.pad(lbl, [0, 0, pw, ph], fill=IGNORE)
            w, h = img.size
            x0, y0 = random.randint(0, w - self.crop), random.randint(0, h - self.crop)
            img = img.crop((x0, y0, x0 + self.crop, y0 + self.crop))
            lbl = lbl.crop((x0, y0, x0 + self.crop, y0 + self.crop))
            if random.random() < 0.5:
                img, lbl = TF.hflip(img), TF.hflip(lbl)
        img = TF.normalize(TF.to_tensor(img), MEAN, STD)
        return img, torch.as_tensor(np.array(lbl), dtype=torch.long)


class ShardSampler(Sampler):
    """Contiguous, non-padded shard of the eval set for this rank."""

    def __init__(self, n, rank, world):
        per = math.ceil(n / world)
        self.idx = list(range(rank * per, min(n, (rank + 1) * per)))

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return len(self.idx)


def build_file_list(root, split, cache):
    if os.path.exists(cache):
        with open(cache) as f:
            return json.load(f)
    imgs = sorted(glob.glob(os.path.join(root, "leftImg8bit", split, "*", "*_leftImg8bit.png")))
    pairs = []
    for im in imgs:
        lbl = im.replace("leftImg8bit", "gtFine", 1).replace("_leftImg8bit.png", "_gtFine_labelTrainIds.png")
        pairs.append((im, lbl))
    tmp = cache + ".tmp"
    with open(tmp, "w") as f:
        json.dump(pairs, f)
    os.replace(tmp, cache)
    return pairs


class DeepLabV3Plus(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        r = resnet101(replace_stride_with_dilation=[False, False, True])
        self.backbone = IntermediateLayerGetter(r, {"layer1": "low", "layer4": "out"})
        self.aspp = ASPP(2048, [6, 12, 18], out_channels=256)
        self.low_proj = nn.Sequential(nn.Conv2d(256, 48, 1, bias=False), nn.BatchNorm2d(48), nn.ReLU(True))
        self.decoder = nn.Sequential(
            nn.Conv2d(304, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True),
            nn.Conv2d(256, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True),
            nn.Conv2d(256, num_classes, 1))

    def forward(self, x):
        size = x.shape[-2:]
        feats = self.backbone(x)
        y = self.aspp(feats["out"])
        low = self.low_proj(feats["low"])
        y = F.interpolate(y, size=low.shape[-2:], mode="bilinear", align_corners=False)
        y = self.decoder(torch.cat([y, low], 1))
        return F.interpolate(y, size=size, mode="bilinear", align_corners=False)


@torch.no_grad()
def slide_inference(model, img, crop=768, stride=512):
    _, _, H, W = img.shape
    logits = img.new_zeros((img.shape[0], NUM_CLASSES, H, W))
    count = img.new_zeros((img.shape[0], 1, H, W))
    for y in range(0, max(H - crop, 0) + stride, stride):
        for x in range(0, max(W - crop, 0) + stride, stride):
            y1, x1 = min(y, max(H - crop, 0)), min(x, max(W - crop, 0))
            y2, x2 = min(y1 + crop, H), min(x1 + crop, W)
            logits[:, :, y1:y2, x1:x2] += model(img[:, :, y1:y2, x1:x2])
            count[:, :, y1:y2, x1:x2] += 1
    return logits / count


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    hist = torch.zeros(NUM_CLASSES * NUM_CLASSES, dtype=torch.int64, device=device)
    for img, lbl in loader:
        img, lbl = img.to(device), lbl.to(device)
        pred = slide_inference(net, img).argmax(1)
        k = lbl != IGNORE
        hist += torch.bincount(lbl[k] * NUM_CLASSES + pred[k], minlength=NUM_CLASSES ** 2)
    dist.all_reduce(hist, op=dist.ReduceOp.SUM)
    hist = hist.view(NUM_CLASSES, NUM_CLASSES).double()
    iou = hist.diag() / (hist.sum(0) + hist.sum(1) - hist.diag())
    net.train()
    return torch.nanmean(iou).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1234 + rank)
    torch.manual_seed(1234)

    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        build_file_list(args.data_root, "train", os.path.join(args.work_dir, "train_files.json"))
        build_file_list(args.data_root, "val", os.path.join(args.work_dir, "val_files.json"))
    dist.barrier(device_ids=[local_rank])
    train_files = build_file_list(args.data_root, "train", os.path.join(args.work_dir, "train_files.json"))
    val_files = build_file_list(args.data_root, "val", os.path.join(args.work_dir, "val_files.json"))

    train_ds = Cityscapes(train_files, args.crop, train=True)
    val_ds = Cityscapes(val_files, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1234, drop_last=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, 1, sampler=ShardSampler(len(val_ds), rank, world), num_workers=2)

    net = DeepLabV3Plus(NUM_CLASSES)
    state = torch.load(args.pretrained, map_location="cpu")
    state = {k.replace("module.", "", 1): v for k, v in state.get("state_dict", state).items()}
    missing, unexpected = net.backbone.load_state_dict(state, strict=False)
    if rank == 0:
        print(f"backbone init: {len(missing)} missing, {len(unexpected)} unexpected keys")
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    # SyncBN keeps running stats identical across ranks already
    model = DDP(net, device_ids=[local_rank], output_device=local_rank, broadcast_buffers=False)

    total_batch = args.batch_size * world
    lr = args.base_lr * total_batch / 16
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE)

    start_iter, best = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_iter, best = ckpt["iter"], ckpt["best"]

    it, epoch = start_iter, start_iter // len(train_loader)
    t0 = time.time()
    while it < args.iters:
        train_sampler.set_epoch(epoch)
        for img, lbl in train_loader:
            cur_lr = lr * (1 - it / args.iters) ** 0.9
            for g in optimizer.param_groups:
                g["lr"] = cur_lr
            img, lbl = img.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
            loss = criterion(model(img), lbl)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            it += 1
            if rank == 0 and it % 50 == 0:
                print(f"[{it}/{args.iters}] loss={loss.item():.4f} lr={cur_lr:.2e} "
                      f"{(time.time() - t0) / 50:.3f}s/it", flush=True)
                t0 = time.time()
            if it % args.eval_every == 0 or it == args.iters:
                miou = evaluate(net, val_loader, device)
                if rank == 0:
                    print(f"iter {it}: mIoU {miou * 100:.2f}", flush=True)
                    ckpt = {"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                            "iter": it, "best": max(best, miou)}
                    torch.save(ckpt, os.path.join(args.work_dir, "last.pth"))
                    if miou > best:
                        torch.save(ckpt, os.path.join(args.work_dir, "best.pth"))
                best = max(best, miou)
                dist.barrier(device_ids=[local_rank])
            if it >= args.iters:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
