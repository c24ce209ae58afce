#!/usr/bin/env python3
"""U-Net semantic segmentation with an in-process torch.distributed.run launcher.

    # one node, 4 GPUs, up to 3 elastic restarts
    python 04_elastic_run_unet_seg.py --nproc-per-node 4 --data /datasets/roads --out runs/unet

The launcher calls torch.distributed.run programmatically (same as `torchrun`),
so agents restart the workers after a failure and the workers pick up from
<out>/checkpoint.pth. Per-rank stdout/stderr go to <out>/elastic_logs.
"""
import argparse
import glob
import os
import shutil
import sys
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


def build_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    # launcher options
    p.add_argument("--nnodes", default="1")
    p.add_argument("--nproc-per-node", type=int, default=4)
    p.add_argument("--rdzv-endpoint", default="localhost:29411")
    p.add_argument("--job-id", default="unet-seg")
    p.add_argument("--max-restarts", type=int, default=3)
    # training options
    p.add_argument("--data", default="/datasets/roads")
    p.add_argument("--out", default="runs/unet")
    p.add_argument("--num-classes", type=int, default=3)
    p.add_argument("--crop", type=int, default=384)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=8, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=6)
    return p


class SegFolder(Dataset):
    """<root>/<split>/images/*.png with masks of the same name under masks/."""

    def __init__(self, root, split, crop=None):
        self.images = sorted(glob.glob(os.path.join(root, split, "images", "*.png")))
        self.masks = [p.replace(os.sep + "images" + os.sep, os.sep + "masks" + os.sep) for p in self.images]
        self.crop = crop

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = np.asarray(Image.open(self.images[i]).convert("RGB"), dtype=np.float32) / 255.0
        mask = np.asarray(Image.open(self.masks[i]), dtype=np.int64)
        if self.crop:
            h, w = mask.shape
            y = np.random.randint(0, h - self.crop + 1)
            x = np.random.randint(0, w - self.crop + 1)
            img = img[y:y + self.crop, x:x + self.crop]
            mask = mask[y:y + self.crop, x:x + self.crop]
            if np.random.rand() < 0.5:
                img, mask = img[:, ::-1], mask[:, ::-1]
        img = (img - 0.5) / 0.25
        return torch.from_numpy(img.transpose(2, 0, 1).copy()), torch.from_numpy(mask.copy())


def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class UNet(nn.Module):
    def __init__(self, num_classes, width=32):
        super().__init__()
        chs = [width * 2 ** i for i in range(5)]
        self.downs = nn.ModuleList([conv_block(3, chs[0])] +
                                   [conv_block(chs[i], chs[i + 1]) for i in range(4)])
        self.ups = nn.ModuleList([nn.ConvTranspose2d(chs[i + 1], chs[i], 2, stride=2) for i in reversed(range(4))])
        self.dec = nn.ModuleList([conv_block(chs[i] * 2, chs[i]) for i in reversed(range(4))])
        self.head = nn.Conv2d(chs[0], num_classes, 1)

    def forward(self, x):
        skips = []
        for i, down in enumerate(self.downs):
            x = down(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        skips.pop()
        for up, dec in zip(self.ups, self.dec):
            x = dec(torch.cat([up(x), skips.pop()], dim=1))
        return self.head(x)


@torch.no_grad()
def evaluate(model, loader, num_classes, device):
    model.eval()
    conf = torch.zeros(num_classes, num_classes, dtype=torch.long, device=device)
    for img, mask in loader:
        img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
        pred = model(img).argmax(1)
        valid = mask < num_classes
        conf += torch.bincount(mask[valid] * num_classes + pred[valid],
                               minlength=num_classes ** 2).view(num_classes, num_classes)
    dist.all_reduce(conf)
    iou = conf.diag().float() / (conf.sum(0) + conf.sum(1) - conf.diag()).clamp(min=1).float()
    model.train()
    return iou.mean().item(), iou.tolist()


def save_checkpoint(state, out_dir, is_best):
    path = os.path.join(out_dir, "checkpoint.pth")
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, os.path.join(out_dir, "model_best.pth"))


def worker(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    train_ds = SegFolder(args.data, "train", crop=args.crop)
    val_ds = SegFolder(args.data, "val")
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_sub = torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world_size))
    val_loader = DataLoader(val_sub, batch_size=1, num_workers=2)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(UNet(args.num_classes)).to(device)
    # global batch = batch_size * world_size; lr follows it linearly from a reference of 32
    lr = args.lr * args.batch_size * world_size / 32
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader), pct_start=0.05)
    start_epoch, best_miou = 0, 0.0
    ckpt_file = os.path.join(args.out, "checkpoint.pth")
    if os.path.isfile(ckpt_file):
        ckpt = torch.load(ckpt_file, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_miou = ckpt["epoch"] + 1, ckpt["best_miou"]
    model = DDP(model, device_ids=[local_rank])
    if rank == 0:
        print(f"restart={restart} world={world_size} start_epoch={start_epoch} lr={lr:.2e}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (img, mask) in enumerate(train_loader):
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(img)
            loss = F.cross_entropy(logits.float(), mask, ignore_index=255)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % 20 == 0:
                print(f"ep {epoch} it {step}/{len(train_loader)} loss {loss.item():.4f}", flush=True)

        miou, per_class = evaluate(model.module, val_loader, args.num_classes, device)
        is_best = miou > best_miou
        best_miou = max(miou, best_miou)
        if rank == 0:
            print(f"ep {epoch} mIoU {miou:.4f} per-class {[round(v, 3) for v in per_class]} "
                  f"({time.time() - t0:.0f}s)", flush=True)
        save_checkpoint({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "epoch": epoch, "best_miou": best_miou},
                        args.out, is_best)
        dist.barrier()

    dist.destroy_process_group()


def launch(args):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run as elastic_run

    os.makedirs(args.out, exist_ok=True)
    run_argv = [
        f"--nnodes={args.nnodes}",
        f"--nproc-per-node={args.nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={args.rdzv_endpoint}",
        f"--rdzv-id={args.job_id}",
        f"--max-restarts={args.max_restarts}",
        f"--log-dir={os.path.join(args.out, 'elastic_logs')}",
        "--redirects=3",
        "--tee=3",
        os.path.abspath(__file__),
        "--worker",
        *sys.argv[1:],
    ]
    try:
        elastic_run(get_args_parser().parse_args(run_argv))
    except ChildFailedError as err:
        print(f"training failed after {args.max_restarts} restarts:\n{err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    cli = build_parser().parse_args()
    if cli.worker:
        worker(cli)
    else:
        sys.exit(launch(cli))
