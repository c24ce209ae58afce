"""Swin-T fine-tuning on iNaturalist-2021 with a side-stream CUDA prefetcher and GPU mixup.

torchrun --nproc_per_node=8 14_inat_cuda_prefetcher.py --data-root /data/inat2021 --pretrained
"""
import argparse
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def args_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", required=True)
    p.add_argument("--num-classes", type=int, default=10000)
    p.add_argument("--pretrained", action="store_true")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4, help="per 512 images")
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--mixup", type=float, default=0.8)
    p.add_argument("--cutmix", type=float, default=1.0)
    p.add_argument("--output-dir", default="/shared/inat/swin_t")
    return p.parse_args()


class CudaPrefetcher:
    """Overlaps the host-to-device copy of batch i+1 with the compute of batch i."""

    def __init__(self, loader, mean, std):
        self.loader = loader
        self.mean = torch.tensor([m * 255 for m in mean]).cuda().view(1, 3, 1, 1)
        self.std = torch.tensor([s * 255 for s in std]).cuda().view(1, 3, 1, 1)

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        stream = torch.cuda.Stream()
        first = True
        for x, y in self.loader:
            with torch.cuda.stream(stream):
                nx = x.cuda(non_blocking=True).float().sub_(self.mean).div_(self.std)
                ny = y.cuda(non_blocking=True)
            if not first:
                yield cur_x, cur_y
            else:
                first = False
            torch.cuda.current_stream().wait_stream(stream)
            nx.record_stream(torch.cuda.current_stream())
            ny.record_stream(torch.cuda.current_stream())
            cur_x, cur_y = nx, ny
        if not first:
            yield cur_x, cur_y


def uint8_collate(batch):
    imgs = torch.stack([torch.as_tensor(b[0]) for b in batch])
    labels = torch.tensor([b[1] for b in batch], dtype=torch.long)
    return imgs, labels


def main():
    args = args_parser()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}")
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()

    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.RandomHorizontalFlip(),
        transforms.PILToTensor(),
    ])
    val_tf = transforms.Compose([
        transforms.Resize(256, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(224),
        transforms.PILToTensor(),
    ])
    train_set = datasets.ImageFolder(os.path.join(args.data_root, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data_root, "val"), val_tf)
    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              collate_fn=uint8_collate, persistent_workers=True)
    val_subset = torch.utils.data.Subset(val_set, range(rank, len(val_set), world))
    val_loader = DataLoader(val_subset, batch_size=128, num_workers=args.workers, pin_memory=True,
                            collate_fn=uint8_collate)
    train_prefetch = CudaPrefetcher(train_loader, MEAN, STD)
    val_prefetch = CudaPrefetcher(val_loader, MEAN, STD)

    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=args.pretrained,
                              num_classes=args.num_classes, drop_path_rate=0.2)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    mixup = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=0.1,
                  num_classes=args.num_classes)
    train_crit = SoftTargetCrossEntropy()
    lr = args.lr * args.batch_size * world / 512
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    steps = len(train_prefetch) * args.epochs
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps,
                                                    pct_start=0.05, anneal_strategy="cos")
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        for i, (x, y) in enumerate(train_prefetch):
            x, y_soft = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = train_crit(model(x), y_soft)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if rank == 0 and i % 100 == 0:
                print(f"[{epoch}] {i}/{len(train_prefetch)} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

        model.eval()
        res = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_prefetch:
                with torch.autocast("cuda", dtype=torch.float16):
                    pred = model.module(x).argmax(1)
                res[0] += (pred == y).sum()
                res[1] += y.numel()
        dist.all_reduce(res)
        acc = (res[0] / res[1]).item() * 100
        if rank == 0:
            print(f"epoch {epoch} val top1 {acc:.2f} ({time.time() - start:.0f}s)", flush=True)
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch}
            torch.save(ckpt, os.path.join(args.output_dir, "last.pth"))
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(), os.path.join(args.output_dir, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
