"""
CSRNet with BatchNorm (VGG16-BN frontend) on ShanghaiTech Part B.

Part B images are all 768x1024, so we train on random 512x512 crops with a
per-GPU batch of 8 and evaluate on full images.

    torchrun --nproc_per_node=4 15_csrnet_bn_shtech_b.py \
        --train-json data/part_B_train.json --val-json data/part_B_test.json --sync-bn
"""
import argparse
import json
import os
import random
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms


def get_args():
    ap = argparse.ArgumentParser("CSRNet-BN / SHB")
    ap.add_argument("--train-json", required=True, help="list of image paths")
    ap.add_argument("--val-json", required=True)
    ap.add_argument("--output", default="ckpt/csrnet_bn_shb")
    ap.add_argument("--crop", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--momentum", type=float, default=0.95)
    ap.add_argument("--decay", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--sync-bn", action="store_true")
    ap.add_argument("--workers", type=int, default=4)
    return ap.parse_args()


class ShanghaiTechB(Dataset):
    """Expects <img>.h5 next to each image holding the precomputed 'density' (sigma=15, fixed kernel)."""

    def __init__(self, img_list, crop=None, train=True):
        self.imgs, self.crop, self.train = img_list, crop, train
        self.tf = transforms.Compose([transforms.ToTensor(),
                                      transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.imgs)

    def __getitem__(self, i):
        path = self.imgs[i]
        img = Image.open(path).convert("RGB")
        gt_path = path.replace(".jpg", ".h5").replace("images", "ground-truth")
        with h5py.File(gt_path, "r") as hf:
            den = np.asarray(hf["density"], dtype=np.float32)
        if self.train:
            w, h = img.size
            x0, y0 = random.randint(0, w - self.crop), random.randint(0, h - self.crop)
            img = img.crop((x0, y0, x0 + self.crop, y0 + self.crop))
            den = den[y0:y0 + self.crop, x0:x0 + self.crop]
            if random.random() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
                den = np.fliplr(den)
        hh, ww = den.shape
        den = den[: hh // 8 * 8, : ww // 8 * 8]
        den8 = den.reshape(den.shape[0] // 8, 8, den.shape[1] // 8, 8).sum((1, 3))
        img = img.crop((0, 0, den.shape[1], den.shape[0]))
        return self.tf(img), torch.from_numpy(np.ascontiguousarray(den8))[None], os.path.basename(path)


def vgg_layers(cfg, in_ch=3, dilation=1, bn=True):
    layers = []
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
            continue
        layers.append(nn.Conv2d(in_ch, v, 3, padding=dilation, dilation=dilation))
        if bn:
            layers.append(nn.BatchNorm2d(v))
        layers.append(nn.ReLU(inplace=True))
        in_ch = v
    return nn.Sequential(*layers)


class CSRNetBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.frontend = vgg_layers([64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512])
        self.backend = vgg_layers([512, 512, 512, 256, 128, 64], in_ch=512, dilation=2)
        self.output_layer = nn.Conv2d(64, 1, 1)
        pretrained = models.vgg16_bn(weights="IMAGENET1K_V1").features.state_dict()
        own = self.frontend.state_dict()
        # both enumerate conv / bn tensors in the same order for the first 10 conv blocks
        for (k, v), pv in zip(own.items(), pretrained.values()):
            own[k] = pv if pv.shape == v.shape else v
        self.frontend.load_state_dict(own)

    def forward(self, x):
        return self.output_layer(self.backend(self.frontend(x)))


@torch.no_grad()
def validate(model, loader, world_size):
    model.eval()
    local = {}
    for img, den, name in loader:
        pred = model(img.cuda(non_blocking=True)).sum().item()
        local[name[0]] = (pred, den.sum().item())
    parts = [None] * world_size
    dist.all_gather_object(parts, local)
    merged = {}
    for p in parts:
        merged.update(p)  # DistributedSampler pads by repeating images; the dict keeps each once
    err = np.array([p - g for p, g in merged.values()])
    return float(np.abs(err).mean()), float(np.sqrt((err ** 2).mean()))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)

    with open(args.train_json) as f:
        train_list = json.load(f)
    with open(args.val_json) as f:
        val_list = json.load(f)
    train_set = ShanghaiTechB(train_list, crop=args.crop, train=True)
    val_set = ShanghaiTechB(val_list, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    model = CSRNetBN()
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    model.cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.decay)

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
    best_mae = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        losses = []
        for img, den, _ in train_loader:
            img, den = img.cuda(non_blocking=True), den.cuda(non_blocking=True)
            out = model(img)
            loss = F.mse_loss(out, den, reduction="sum") / (2 * img.size(0))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        mae, mse = validate(model, val_loader, world_size)
        if rank == 0:
            print(f"epoch {epoch:3d} loss {np.mean(losses):.4f} | MAE {mae:.2f} MSE {mse:.2f} | {time.time() - t0:.0f}s",
                  flush=True)
            if mae < best_mae:
                best_mae = mae
                torch.save({"epoch": epoch, "state_dict": model.module.state_dict(), "mae": mae, "mse": mse},
                           os.path.join(args.output, "model_best.pth"))
            torch.save({"epoch": epoch, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict()}, os.path.join(args.output, "checkpoint.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
