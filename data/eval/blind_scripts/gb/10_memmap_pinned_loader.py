"""Downsampled-ImageNet (64x64) training from a uint8 memmap with a threaded pinned-memory loader.

The whole train set lives in one .npy memmap; batches are gathered by index on a
background thread into pinned buffers and copied to the GPU asynchronously.
Crops/flips/jitter run on the GPU with kornia.

    torchrun --nproc_per_node=8 10_memmap_pinned_loader.py --data /fast/imagenet64
"""
import argparse
import os
import queue
import threading
import time

import kornia.augmentation as K
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler


def get_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=str, required=True)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.2, help="per 256")
    parser.add_argument("--wd", type=float, default=5e-4)
    parser.add_argument("--prefetch", type=int, default=6)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--out", type=str, default="./out_in64")
    return parser


class IndexDataset(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


class PinnedBatchLoader:
    """Reads batches of rows from memmapped arrays into pinned memory on a worker thread."""

    def __init__(self, images, labels, sampler, batch_size, device, prefetch=4, drop_last=True):
        self.images, self.labels = images, labels
        self.sampler, self.batch_size = sampler, batch_size
        self.device, self.prefetch, self.drop_last = device, prefetch, drop_last
        self.stream = torch.cuda.Stream(device=device)

    def __len__(self):
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _producer(self, q, order):
        for b in range(len(self)):
            idx = np.sort(order[b * self.batch_size:(b + 1) * self.batch_size])
            x = torch.from_numpy(np.ascontiguousarray(self.images[idx])).pin_memory()
            y = torch.from_numpy(self.labels[idx].astype(np.int64)).pin_memory()
            q.put((x, y))
        q.put(None)

    def __iter__(self):
        order = np.fromiter(iter(self.sampler), dtype=np.int64)
        q = queue.Queue(maxsize=self.prefetch)
        t = threading.Thread(target=self._producer, args=(q, order), daemon=True)
        t.start()
        while True:
            item = q.get()
            if item is None:
                break
            with torch.cuda.stream(self.stream):
                x = item[0].to(self.device, non_blocking=True)
                y = item[1].to(self.device, non_blocking=True)
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            x.record_stream(torch.cuda.current_stream(self.device))
            y.record_stream(torch.cuda.current_stream(self.device))
            yield x, y
        t.join()


def build_model(num_classes=1000):
    m = torchvision.models.resnet18(num_classes=num_classes)
    # 64x64 inputs: 3x3 stem without the max-pool
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()

    # NHWC uint8 memmaps written once by a preprocessing job
    x_train = np.load(os.path.join(args.data, "train_x.npy"), mmap_mode="r")
    y_train = np.load(os.path.join(args.data, "train_y.npy"), mmap_mode="r")
    x_val = np.load(os.path.join(args.data, "val_x.npy"), mmap_mode="r")
    y_val = np.load(os.path.join(args.data, "val_y.npy"), mmap_mode="r")

    train_sampler = DistributedSampler(IndexDataset(len(y_train)), num_replicas=world_size, rank=rank,
                                       shuffle=True, seed=0, drop_last=True)
    train_loader = PinnedBatchLoader(x_train, y_train, train_sampler, args.batch_size, device,
                                     prefetch=args.prefetch)
    val_idx = np.arange(rank, len(y_val), world_size)

    gpu_aug = nn.Sequential(
        K.RandomCrop((64, 64), padding=4),
        K.RandomHorizontalFlip(),
        K.ColorJitter(0.2, 0.2, 0.2, p=0.5),
    ).to(device)
    mean = torch.tensor([0.481, 0.457, 0.408], device=device).view(1, 3, 1, 1)
    std = torch.tensor([0.260, 0.253, 0.268], device=device).view(1, 3, 1, 1)

    def prep(x_uint8_nhwc):
        return (x_uint8_nhwc.permute(0, 3, 1, 2).float().div_(255) - mean) / std

    model = build_model().to(device, memory_format=torch.channels_last)
    model = DDP(model, device_ids=[args.local_rank])
    lr = args.lr * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True,
                                weight_decay=args.wd)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total,
                                                pct_start=0.15, div_factor=25)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (x, y) in enumerate(train_loader):
            x = gpu_aug(prep(x)).contiguous(memory_format=torch.channels_last)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sched.step()
        torch.cuda.synchronize()
        epoch_time = time.time() - t0

        model.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad():
            for s in range(0, len(val_idx), 1000):
                idx = val_idx[s:s + 1000]
                xv = torch.from_numpy(np.ascontiguousarray(x_val[idx])).to(device, non_blocking=True)
                yv = torch.from_numpy(y_val[idx].astype(np.int64)).to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model.module(prep(xv).contiguous(memory_format=torch.channels_last)).argmax(1)
                hits += torch.stack([(pred == yv).sum().float(), torch.tensor(float(len(idx)), device=device)])
        dist.all_reduce(hits)
        if rank == 0:
            imgs_per_s = len(train_loader) * args.batch_size * world_size / epoch_time
            print(f"epoch {epoch:3d} top1 {100 * hits[0].item() / hits[1].item():.2f} "
                  f"{imgs_per_s:.0f} img/s", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "sched": sched.state_dict()},
                       os.path.join(args.out, "ckpt.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
