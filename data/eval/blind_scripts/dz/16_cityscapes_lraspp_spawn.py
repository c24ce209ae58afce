"""LR-ASPP MobileNetV3-Large on Cityscapes, launched with torch.multiprocessing.spawn
(one process per local GPU; multi-node via --nnodes/--node-rank/--master-addr).

    python 16_cityscapes_lraspp_spawn.py --data /datasets/cityscapes --gpus 4
"""
import argparse
import glob
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.segmentation import lraspp_mobilenet_v3_large

NUM_CLASSES = 19
IGNORE = 255


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/datasets/cityscapes")
    p.add_argument("--out", default="runs/lraspp_mnv3_cs")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", default="29531")
    p.add_argument("--pretrained", default="pretrained/mobilenet_v3_large_imagenet.pth")
    p.add_argument("--resume", default="")
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--crop", type=int, nargs=2, default=[512, 1024])
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--val-every", type=int, default=25)
    return p.parse_args()


class RandomScaleCrop:
    def __init__(self, crop, scale=(0.5, 2.0)):
        self.crop, self.scale = crop, scale

    def __call__(self, img, lbl):
        s = random.uniform(*self.scale)
        size = (int(img.width * s), int(img.height * s))
        img, lbl = img.resize(size, Image.BILINEAR), lbl.resize(size, Image.NEAREST)
        img, lbl = np.asarray(img, np.float32), np.asarray(lbl, np.int64)
        ch, cw = self.crop
        ph, pw = max(ch - lbl.shape[0], 0), max(cw - lbl.shape[1], 0)
        img = np.pad(img, ((0, ph), (0, pw), (0, 0)))
        lbl = np.pad(lbl, ((0, ph), (0, pw)), constant_values=IGNORE)
        y, x = random.randint(0, lbl.shape[0] - ch), random.randint(0, lbl.shape[1] - cw)
        img, lbl = img[y:y + ch, x:x + cw], lbl[y:y + ch, x:x + cw]
        if random.random() < 0.5:
            img, lbl = img[:, ::-1], lbl[:, ::-1]
        return img, lbl


class Cityscapes(Dataset):
    mean = np.array([123.675, 116.28, 103.53], np.float32)
    std = np.array([58.395, 57.12, 57.375], np.float32)

    def __init__(self, root, split, transform=None):
        self.imgs = sorted(glob.glob(f"{root}/leftImg8bit/{split}/*/*_leftImg8bit.png"))
        self.transform = transform

    def __len__(self):
        return len(self.imgs)

    def __getitem__(self, i):
        img = Image.open(self.imgs[i]).convert("RGB")
        lbl = Image.open(self.imgs[i].replace("/leftImg8bit/", "/gtFine/")
                         .replace("_leftImg8bit.png", "_gtFine_labelTrainIds.png"))
        if self.transform is not None:
            img, lbl = self.transform(img, lbl)
        else:
            img, lbl = np.asarray(img, np.float32), np.asarray(lbl, np.int64)
        img = (img - self.mean) / self.std
        return torch.from_numpy(img.transpose(2, 0, 1).copy()), torch.from_numpy(lbl.copy())


def strip_prefix(state, prefix="module."):
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}


@torch.no_grad()
def validate(model, loader, rank, world, n_total, device):
    model.eval()
    hist = torch.zeros(NUM_CLASSES * NUM_CLASSES, dtype=torch.int64, device=device)
    for k, (img, lbl) in enumerate(loader):
        # DistributedSampler pads the last round with repeats of the first images; skip them
        if rank + k * world >= n_total:
            continue
        img, lbl = img.to(device), lbl.to(device)
        pred = model(img)["out"].argmax(1)
        m = lbl != IGNORE
        hist += torch.bincount(lbl[m] * NUM_CLASSES + pred[m], minlength=NUM_CLASSES ** 2)
    dist.all_reduce(hist)
    h = hist.view(NUM_CLASSES, NUM_CLASSES).double()
    model.train()
    return h.diag() / (h.sum(0) + h.sum(1) - h.diag())


def main_worker(gpu, ngpus_per_node, args):
    rank = args.node_rank * ngpus_per_node + gpu
    world_size = args.nnodes * ngpus_per_node
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=f"tcp://{args.master_addr}:{args.master_port}",
                            world_size=world_size, rank=rank)
    device = torch.device("cuda", gpu)
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(0)

    train_ds = Cityscapes(args.data, "train", RandomScaleCrop(tuple(args.crop)))
    val_ds = Cityscapes(args.data, "val")
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, args.bs, sampler=train_sampler, num_workers=4, pin_memory=True,
                              drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, 1, sampler=val_sampler, num_workers=2)

    net = lraspp_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=NUM_CLASSES)
    if args.pretrained and os.path.isfile(args.pretrained):
        sd = strip_prefix(torch.load(args.pretrained, map_location="cpu"))
        net.backbone.load_state_dict({k.replace("features.", "", 1): v for k, v in sd.items()
                                      if k.startswith("features.")}, strict=False)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[gpu], output_device=gpu)

    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9, weight_decay=4e-5)
    start_epoch, best = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=f"cuda:{gpu}")
        net.load_state_dict(strip_prefix(ckpt["model"]))
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best = ckpt["epoch"], ckpt.get("best", 0.0)

    iters_per_epoch = len(train_loader)
    max_iter = args.epochs * iters_per_epoch
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world_size}, {iters_per_epoch} it/epoch, {max_iter} it total", flush=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (img, lbl) in enumerate(train_loader):
            cur = epoch * iters_per_epoch + i
            for g in optimizer.param_groups:
                g["lr"] = args.lr * (1 - cur / max_iter) ** 0.9
            img, lbl = img.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
            loss = F.cross_entropy(model(img)["out"], lbl, ignore_index=IGNORE)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch + 1} loss {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.val_every == 0 or epoch + 1 == args.epochs:
            iou = validate(net, val_loader, rank, world_size, len(val_ds), device)
            miou = torch.nanmean(iou).item()
            best = max(best, miou)
            if rank == 0:
                print(f"epoch {epoch + 1} mIoU {100 * miou:.2f} best {100 * best:.2f}", flush=True)
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch + 1, "best": best}, os.path.join(args.out, "checkpoint.pth"))
            dist.barrier()

    dist.destroy_process_group()


def main():
    args = get_args()
    mp.spawn(main_worker, nprocs=args.gpus, args=(args.gpus, args), join=True)


if __name__ == "__main__":
    main()
