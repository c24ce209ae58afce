"""SimCLR pre-training on an unlabeled image folder (ResNet-18 backbone).

Port of the TF2 SimCLR code: the NT-Xent loss uses negatives from the *global*
batch (tf.distribute cross-replica gather) and BatchNorm is synchronised
across replicas, as in the paper. Images are decoded and resized once into a
uint8 cache (tf.data .cache()).

    torchrun --nproc_per_node=8 17_simclr_global_negatives.py --images /data/unlabeled --cache cache/simclr_96.pt
"""
import argparse
import datetime
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms.v2 as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--images", required=True)
    p.add_argument("--cache", default="cache/simclr_96.pt")
    p.add_argument("--size", type=int, default=96)
    p.add_argument("--per-replica-batch", type=int, default=256)
    p.add_argument("--base-lr", type=float, default=0.3, help="lr = base_lr * global_batch / 256")
    p.add_argument("--temperature", type=float, default=0.2)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--warmup-epochs", type=int, default=10)
    p.add_argument("--logdir", default="runs/simclr")
    p.add_argument("--resume", default="")
    return p.parse_args()


def build_cache(image_dir, size, path):
    files = sorted(glob.glob(os.path.join(image_dir, "**", "*.jpg"), recursive=True))
    arr = np.empty((len(files), size, size, 3), dtype=np.uint8)
    for i, f in enumerate(files):
        arr[i] = np.asarray(Image.open(f).convert("RGB").resize((size, size), Image.BICUBIC))
    tmp = path + ".partial"
    torch.save(torch.from_numpy(arr), tmp)
    os.replace(tmp, path)


class TwoViews(Dataset):
    def __init__(self, images, size):
        self.images = images  # (N, H, W, 3) uint8
        self.aug = T.Compose([
            T.RandomResizedCrop(size, scale=(0.2, 1.0), antialias=True), T.RandomHorizontalFlip(),
            T.RandomApply([T.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8), T.RandomGrayscale(0.2),
            T.ToDtype(torch.float32, scale=True), T.Normalize([0.5] * 3, [0.5] * 3)])

    def __len__(self):
        return self.images.shape[0]

    def __getitem__(self, i):
        img = self.images[i].permute(2, 0, 1)
        return self.aug(img), self.aug(img)


class SimCLR(nn.Module):
    def __init__(self, proj_dim=128):
        super().__init__()
        self.encoder = torchvision.models.resnet18(weights=None)
        self.encoder.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.encoder.maxpool = nn.Identity()
        feat = self.encoder.fc.in_features
        self.encoder.fc = nn.Identity()
        self.projector = nn.Sequential(nn.Linear(feat, 2048), nn.BatchNorm1d(2048), nn.ReLU(inplace=True),
                                       nn.Linear(2048, proj_dim))

    def forward(self, x):
        return self.projector(self.encoder(x))


def nt_xent(z1, z2, temperature, rank):
    """Local queries against the global batch of keys."""
    z1, z2 = F.normalize(z1, dim=1), F.normalize(z2, dim=1)
    # autograd-aware all_gather: gradients flow back to the replica that produced each row
    k1 = torch.cat(dist_fn.all_gather(z1), dim=0)
    k2 = torch.cat(dist_fn.all_gather(z2), dim=0)
    n = z1.size(0)
    labels = torch.arange(n, device=z1.device) + rank * n
    keys = torch.cat([k1, k2], dim=0)  # (2 * global_batch, d)
    big_n = k1.size(0)
    mask_self = F.one_hot(labels, 2 * big_n).bool()
    logits1 = (z1 @ keys.t() / temperature).masked_fill(mask_self, float("-inf"))
    logits2 = (z2 @ keys.t() / temperature).masked_fill(F.one_hot(labels + big_n, 2 * big_n).bool(), float("-inf"))
    return 0.5 * (F.cross_entropy(logits1, labels + big_n) + F.cross_entropy(logits2, labels))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # generous timeout: on a fresh node rank 0 spends a while building the cache before the first barrier
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1000 + rank)  # independent augmentation streams; DDP copies rank 0's initial weights

    if rank == 0 and not os.path.exists(args.cache):
        print(f"building image cache at {args.cache}", flush=True)
        os.makedirs(os.path.dirname(args.cache) or ".", exist_ok=True)
        build_cache(args.images, args.size, args.cache)
    dist.barrier()
    images = torch.load(args.cache, map_location="cpu")

    ds = TwoViews(images, args.size)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    # drop_last: every replica must contribute the same number of rows to the gather
    loader = DataLoader(ds, batch_size=args.per_replica_batch, sampler=sampler, num_workers=10,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(SimCLR()).to(device)
    model = DDP(model, device_ids=[local_rank])
    global_batch = args.per_replica_batch * world
    lr = args.base_lr * global_batch / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-6)
    steps_per_epoch = len(loader)
    total, warm = args.epochs * steps_per_epoch, args.warmup_epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1

    writer = SummaryWriter(args.logdir) if rank == 0 else None
    if rank == 0:
        print(f"images={len(ds)} replicas={world} global_batch={global_batch} lr={lr:.3f} "
              f"negatives/query={2 * global_batch - 2}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros((), device=device)
        for step, (v1, v2) in enumerate(loader):
            v1, v2 = v1.to(device, non_blocking=True), v2.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                z = model(torch.cat([v1, v2], dim=0)).float()
            z1, z2 = z.chunk(2)
            loss = nt_xent(z1, z2, args.temperature, rank)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_sum += loss.detach()
            if writer is not None and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), epoch * steps_per_epoch + step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], epoch * steps_per_epoch + step)
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)

        if rank == 0:
            epoch_loss = loss_sum.item() / steps_per_epoch
            writer.add_scalar("epoch/loss", epoch_loss, epoch)
            print(f"epoch {epoch + 1}/{args.epochs} loss {epoch_loss:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "epoch": epoch},
                       os.path.join(args.logdir, "simclr_last.pt"))

    if writer is not None:
        writer.close()
        torch.save(model.module.encoder.state_dict(), os.path.join(args.logdir, "encoder_final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
