"""I3D-style ResNet-50 inflated from ImageNet weights, trained on Kinetics-400 rawframes.

Frames were extracted beforehand to <root>/rawframes/<split>/<video_id>/img_%05d.jpg.
One process per GPU is started with torch.multiprocessing.spawn:

    python 13_i3d_inflated_spawn.py --root /data/k400 --dist-url tcp://127.0.0.1:23456 \
        --nnodes 1 --node-rank 0 --out /exp/i3d_r50
"""
import argparse
import json
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dist-url", default="tcp://127.0.0.1:23456")
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--stride", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8, help="per GPU")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--warmup-epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.1, help="for a global batch of 64")
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


# --------------------------------------------------------------------------- model
def inflate_conv(conv2d, kt):
    conv3d = nn.Conv3d(conv2d.in_channels, conv2d.out_channels, kernel_size=(kt, *conv2d.kernel_size),
                       stride=(1, *conv2d.stride), padding=(kt // 2, *conv2d.padding), bias=False)
    conv3d.weight.data.copy_(conv2d.weight.data.unsqueeze(2).repeat(1, 1, kt, 1, 1) / kt)
    return conv3d


def inflate_bn(bn2d):
    bn3d = nn.BatchNorm3d(bn2d.num_features)
    bn3d.load_state_dict(bn2d.state_dict())
    return bn3d


class Bottleneck3d(nn.Module):
    def __init__(self, block2d, kt):
        super().__init__()
        self.conv1, self.bn1 = inflate_conv(block2d.conv1, kt), inflate_bn(block2d.bn1)
        self.conv2, self.bn2 = inflate_conv(block2d.conv2, 1), inflate_bn(block2d.bn2)
        self.conv3, self.bn3 = inflate_conv(block2d.conv3, 1), inflate_bn(block2d.bn3)
        self.downsample = None
        if block2d.downsample is not None:
            self.downsample = nn.Sequential(inflate_conv(block2d.downsample[0], 1),
                                            inflate_bn(block2d.downsample[1]))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class I3DResNet50(nn.Module):
    def __init__(self, num_classes, imagenet_weights=None):
        super().__init__()
        r2d = torchvision.models.resnet50()
        if imagenet_weights:
            r2d.load_state_dict(torch.load(imagenet_weights, map_location="cpu"))
        self.conv1, self.bn1 = inflate_conv(r2d.conv1, 5), inflate_bn(r2d.bn1)
        # temporal kernels only in res4/res5, as in SlowOnly
        self.layers = nn.ModuleList([
            nn.Sequential(*[Bottleneck3d(b, 3 if i >= 2 else 1) for b in layer])
            for i, layer in enumerate([r2d.layer1, r2d.layer2, r2d.layer3, r2d.layer4])
        ])
        self.dropout = nn.Dropout(0.5)
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool3d(x, kernel_size=(1, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1))
        for layer in self.layers:
            x = layer(x)
        x = F.adaptive_avg_pool3d(x, 1).flatten(1)
        return self.fc(self.dropout(x))


# --------------------------------------------------------------------------- data
def build_frame_index(root, split, cache_path):
    """Counting frames of ~240k folders on NFS takes a while, so the result is cached."""
    frame_dir = os.path.join(root, "rawframes", split)
    index = {}
    with open(os.path.join(root, f"{split}.csv")) as f:
        next(f)
        for line in f:
            label, yid, t0, t1 = line.strip().split(",")[:4]
            vid = f"{yid}_{int(t0):06d}_{int(t1):06d}"
            d = os.path.join(frame_dir, vid)
            if os.path.isdir(d):
                index[vid] = {"label": label, "frames": len(os.listdir(d))}
    tmp = cache_path + f".tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(index, f)
    os.replace(tmp, cache_path)


class RawFrames(Dataset):
    MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1, 1)
    STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1, 1)

    def __init__(self, root, split, index, classes, frames, stride, train):
        self.dir = os.path.join(root, "rawframes", split)
        self.items = sorted(index.items())
        self.cls = {c: i for i, c in enumerate(classes)}
        self.frames, self.stride, self.train = frames, stride, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        vid, meta = self.items[i]
        n, span = meta["frames"], self.frames * self.stride
        s = random.randint(0, max(0, n - span)) if self.train else max(0, n - span) // 2
        ids = [min(s + k * self.stride, n - 1) + 1 for k in range(self.frames)]
        imgs = [np.asarray(Image.open(os.path.join(self.dir, vid, f"img_{k:05d}.jpg")).convert("RGB")) for k in ids]
        x = torch.from_numpy(np.stack(imgs)).permute(0, 3, 1, 2).float() / 255.0
        h, w = x.shape[-2:]
        short = random.randint(256, 320) if self.train else 256
        x = F.interpolate(x, scale_factor=short / min(h, w), mode="bilinear", align_corners=False)
        h, w = x.shape[-2:]
        if self.train:
            a, b = random.randint(0, h - 224), random.randint(0, w - 224)
        else:
            a, b = (h - 224) // 2, (w - 224) // 2
        x = x[..., a:a + 224, b:b + 224]
        if self.train and random.random() < 0.5:
            x = x.flip(-1)
        return (x.transpose(0, 1) - self.MEAN) / self.STD, self.cls[meta["label"]]


class EvalShard(torch.utils.data.Sampler):
    def __init__(self, n, world, rank):
        self.ids = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.ids)

    def __len__(self):
        return len(self.ids)


# --------------------------------------------------------------------------- worker
def main_worker(gpu, ngpus_per_node, args):
    rank = args.node_rank * ngpus_per_node + gpu
    torch.cuda.set_device(gpu)
    dist.init_process_group(backend="nccl", init_method=args.dist_url,
                            world_size=args.world_size, rank=rank)
    device = torch.device("cuda", gpu)
    random.seed(rank)
    torch.manual_seed(rank)

    # one process builds the frame index, the others wait and read it
    index = {}
    for split in ("train", "val"):
        cache = os.path.join(args.out, f"frame_index_{split}.json")
        if rank == 0 and not os.path.exists(cache):
            os.makedirs(args.out, exist_ok=True)
            build_frame_index(args.root, split, cache)
        dist.barrier()
        with open(cache) as f:
            index[split] = json.load(f)
    classes = sorted({m["label"] for m in index["train"].values()})

    train_ds = RawFrames(args.root, "train", index["train"], classes, args.frames, args.stride, train=True)
    val_ds = RawFrames(args.root, "val", index["val"], classes, args.frames, args.stride, train=False)
    sampler = DistributedSampler(train_ds, num_replicas=args.world_size, rank=rank, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, sampler=EvalShard(len(val_ds), args.world_size, rank),
                        num_workers=args.workers, pin_memory=True)

    model = I3DResNet50(len(classes), os.path.join(args.root, "resnet50-11ad3fa6.pth"))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda(gpu)
    model = DDP(model, device_ids=[gpu])

    lr = args.lr * args.batch_size * args.world_size / 64
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    iters = len(train_dl)
    warm, total = args.warmup_epochs * iters, args.epochs * iters
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))
    scaler = torch.cuda.amp.GradScaler()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it}/{iters} loss {loss.item():.4f}", flush=True)

        model.module.eval()
        correct = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    correct[0] += (model.module(x).argmax(1) == y).sum()
                correct[1] += y.numel()
        dist.all_reduce(correct)
        if rank == 0:
            print(f"epoch {epoch}: val top1 {100 * correct[0].item() / correct[1].item():.2f}", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "checkpoint.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    ngpus_per_node = torch.cuda.device_count()
    args.world_size = ngpus_per_node * args.nnodes
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))
