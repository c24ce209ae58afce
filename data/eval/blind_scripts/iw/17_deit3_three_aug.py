#!/usr/bin/env python3
"""DeiT III ("Revenge of the ViT") ViT-B training on ImageNet-1k.

3-Augment (grayscale / solarize / blur), simple random crop, BCE loss with mixup+cutmix,
LayerScale, repeated augmentation, gradient accumulation.
"""
import argparse
import json
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision import datasets, transforms

import timm
from timm.data import Mixup
from timm.loss import BinaryCrossEntropy
from timm.scheduler import CosineLRScheduler

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def args_parser():
    ap = argparse.ArgumentParser("DeiT III")
    ap.add_argument("--data-path", default="/datasets/imagenet")
    ap.add_argument("--model", default="deit3_base_patch16_224")
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU micro-batch")
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=800)
    ap.add_argument("--lr", type=float, default=3e-3, help="for a global batch of 2048")
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--drop-path", type=float, default=0.2)
    ap.add_argument("--num-repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--output-dir", default="./deit3_b")
    ap.add_argument("--resume", default="")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class RASampler(torch.utils.data.Sampler):
    def __init__(self, dataset, num_replicas, rank, num_repeats=3):
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.num_repeats, self.epoch = num_repeats, 0
        self.num_samples = int(math.ceil(len(dataset) * num_repeats / num_replicas))
        self.total_size = self.num_samples * num_replicas
        self.num_selected = int(math.floor(len(dataset) // 256 * 256 / num_replicas))

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.epoch)
        idx = torch.randperm(len(self.dataset), generator=g)
        idx = torch.repeat_interleave(idx, self.num_repeats).tolist()
        idx += idx[: self.total_size - len(idx)]
        return iter(idx[self.rank:self.total_size:self.num_replicas][: self.num_selected])

    def __len__(self):
        return self.num_selected

    def set_epoch(self, epoch):
        self.epoch = epoch


class WithIndex(Dataset):
    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        x, y = self.ds[i]
        return x, y, i


def three_augment(size):
    return transforms.Compose([
        transforms.RandomResizedCrop(size, scale=(0.08, 1.0), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.RandomHorizontalFlip(),
        transforms.RandomChoice([transforms.Grayscale(num_output_channels=3),
                                 transforms.RandomSolarize(threshold=128, p=1.0),
                                 transforms.GaussianBlur(kernel_size=9, sigma=(0.1, 2.0))]),
        transforms.ColorJitter(0.3, 0.3, 0.3),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])


@torch.no_grad()
def evaluate(model, loader, device, n_total):
    """DistributedSampler pads the last shard; gather per-sample results and keep each index once."""
    model.eval()
    idx_l, hit_l = [], []
    for x, y, idx in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x).argmax(-1)
        idx_l.append(idx.to(device))
        hit_l.append((pred == y).long())
    idx_local, hit_local = torch.cat(idx_l), torch.cat(hit_l)
    world = dist.get_world_size()
    idx_all = torch.empty(world * idx_local.numel(), dtype=idx_local.dtype, device=device)
    hit_all = torch.empty(world * hit_local.numel(), dtype=hit_local.dtype, device=device)
    dist.all_gather_into_tensor(idx_all, idx_local)
    dist.all_gather_into_tensor(hit_all, hit_local)
    seen = torch.zeros(n_total, dtype=torch.long, device=device)
    seen[idx_all] = hit_all
    return 100.0 * seen.sum().item() / n_total


def main():
    args = args_parser()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    val_tf = transforms.Compose([
        transforms.Resize(256, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(224), transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    ds_train = datasets.ImageFolder(os.path.join(args.data_path, "train"), three_augment(224))
    ds_val = WithIndex(datasets.ImageFolder(os.path.join(args.data_path, "val"), val_tf))
    sampler = RASampler(ds_train, num_replicas=world, rank=rank, num_repeats=args.num_repeats)
    val_sampler = DistributedSampler(ds_val, num_replicas=world, rank=rank, shuffle=False)
    dl_train = DataLoader(ds_train, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    dl_val = DataLoader(ds_val, batch_size=128, sampler=val_sampler, num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, num_classes=1000, drop_path_rate=args.drop_path).to(device)
    model = DDP(model, device_ids=[local_rank])

    eff_batch = args.batch_size * args.accum * world
    lr = args.lr * eff_batch / 2048
    decay = [p for n, p in model.module.named_parameters() if p.ndim > 1 and "pos_embed" not in n]
    other = [p for n, p in model.module.named_parameters() if p.ndim <= 1 or "pos_embed" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                                   {"params": other, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.999))
    updates_per_epoch = len(dl_train) // args.accum
    scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs * updates_per_epoch, lr_min=1e-5,
                                  warmup_t=args.warmup_epochs * updates_per_epoch, warmup_lr_init=1e-6,
                                  t_in_epochs=False)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.0, num_classes=1000)
    criterion = BinaryCrossEntropy(smoothing=0.0)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"] + 1
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"global batch {eff_batch}, lr {lr:.2e}, {updates_per_epoch} updates/epoch", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        t0 = time.time()
        upd = epoch * updates_per_epoch
        for i, (x, y) in enumerate(dl_train):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            sync = (i + 1) % args.accum == 0
            with (nullcontext() if sync else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = criterion(model(x), y) / args.accum
                loss.backward()
            if sync:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                upd += 1
                scheduler.step_update(upd)
            if rank == 0 and i % 200 == 0:
                print(f"ep {epoch} {i}/{len(dl_train)} loss {loss.item() * args.accum:.4f}", flush=True)

        if epoch % 10 == 9 or epoch == args.epochs - 1:
            top1 = evaluate(model.module, dl_val, device, len(ds_val))
        else:
            top1 = None
        if rank == 0:
            print(json.dumps({"epoch": epoch, "top1": top1, "minutes": (time.time() - t0) / 60}), flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       os.path.join(args.output_dir, "checkpoint.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
