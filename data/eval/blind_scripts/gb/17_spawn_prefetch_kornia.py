"""Single-node multi-GPU training started with torch.multiprocessing.spawn.

CPU workers only decode + resize to uint8; the batch is moved to the GPU on a side
stream and augmented there with kornia.

    python 17_spawn_prefetch_kornia.py --data /data/places365 --gpus 8
"""
import argparse
import os
import time

import kornia.augmentation as K
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1, help="per 256 images")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--port", type=str, default="29531")
    p.add_argument("--ckpt-dir", default="./ckpt_places")
    p.add_argument("--resume", default="")
    return p.parse_args()


def collate_uint8(batch):
    imgs = np.stack([np.asarray(img, dtype=np.uint8) for img, _ in batch])  # N,H,W,C
    labels = np.array([t for _, t in batch], dtype=np.int64)
    return torch.from_numpy(imgs).permute(0, 3, 1, 2).contiguous(), torch.from_numpy(labels)


class GPUPrefetcher:
    def __init__(self, loader, device):
        self.loader, self.device = loader, device
        self.stream = torch.cuda.Stream(device=device)

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        it = iter(self.loader)
        nxt = self._load(it)
        while nxt is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            x, y = nxt
            x.record_stream(torch.cuda.current_stream(self.device))
            y.record_stream(torch.cuda.current_stream(self.device))
            nxt = self._load(it)
            yield x, y

    def _load(self, it):
        try:
            x, y = next(it)
        except StopIteration:
            return None
        with torch.cuda.stream(self.stream):
            return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


def worker(gpu, ngpus, args):
    torch.cuda.set_device(gpu)
    device = torch.device("cuda", gpu)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", world_size=ngpus, rank=gpu)
    torch.backends.cudnn.benchmark = True

    train_set = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "train"),
        transforms.Compose([transforms.Resize(256), transforms.RandomCrop(256)]))
    val_set = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "val"),
        transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224)]))
    train_sampler = DistributedSampler(train_set, num_replicas=ngpus, rank=gpu, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, collate_fn=collate_uint8,
                              drop_last=True, persistent_workers=True)
    val_part = torch.utils.data.Subset(val_set, range(gpu, len(val_set), ngpus))
    val_loader = DataLoader(val_part, batch_size=200, num_workers=args.workers, pin_memory=True,
                            collate_fn=collate_uint8)

    train_aug = nn.Sequential(
        K.RandomResizedCrop((224, 224), scale=(0.2, 1.0)),
        K.RandomHorizontalFlip(),
        K.ColorJitter(0.3, 0.3, 0.3, 0.05, p=0.8),
        K.Normalize(mean=torch.tensor([0.485, 0.456, 0.406]), std=torch.tensor([0.229, 0.224, 0.225])),
    ).to(device)
    val_norm = K.Normalize(mean=torch.tensor([0.485, 0.456, 0.406]),
                           std=torch.tensor([0.229, 0.224, 0.225])).to(device)

    model = torchvision.models.resnet50(num_classes=365).to(device)
    model = DDP(model, device_ids=[gpu])
    base_lr = args.lr * args.batch_size * ngpus / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[20, 40, 50], gamma=0.1)
    criterion = nn.CrossEntropyLoss()

    start_epoch = 0
    if args.resume:
        # checkpoint tensors were saved from cuda:0; remap them onto this process's GPU
        ck = torch.load(args.resume, map_location={"cuda:0": f"cuda:{gpu}"})
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_epoch = ck["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(GPUPrefetcher(train_loader, device)):
            with torch.no_grad():
                x = train_aug(x.float().div_(255))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if gpu == 0 and i % 100 == 0:
                print(f"epoch {epoch} [{i}/{len(train_loader)}] loss {loss.item():.3f}", flush=True)
        scheduler.step()

        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in GPUPrefetcher(val_loader, device):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model.module(val_norm(x.float().div_(255)))
                acc[0] += (out.argmax(1) == y).sum()
                acc[1] += y.numel()
        dist.all_reduce(acc)
        if gpu == 0:
            print(f"epoch {epoch} top1 {100 * acc[0].item() / acc[1].item():.2f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.ckpt_dir, f"epoch{epoch:03d}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
