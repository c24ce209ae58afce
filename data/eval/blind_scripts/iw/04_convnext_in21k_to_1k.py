#!/usr/bin/env python3
"""ConvNeXt-B: fine-tune an ImageNet-22k checkpoint on ImageNet-1k at 384px.

- layer-wise lr decay (12 "layers" like the official repo)
- mixup/cutmix + label smoothing, EMA of weights
- gradient accumulation with no_sync on the micro-steps
- file index of the training folder cached to disk (the NFS listing is slow)
"""
import argparse
import json
import os
import pickle
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

import timm
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV2

try:
    import wandb
except ImportError:
    wandb = None

IMG_EXT = (".jpeg", ".jpg", ".png")


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/nfs/imagenet")
    ap.add_argument("--index-cache", default="/nfs/cache/imagenet_index.pkl")
    ap.add_argument("--model", default="convnext_base")
    ap.add_argument("--pretrained", default="/nfs/ckpt/convnext_base_22k_224.pth")
    ap.add_argument("--img-size", type=int, default=384)
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU micro-batch")
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--warmup-epochs", type=int, default=0)
    ap.add_argument("--blr", type=float, default=5e-5, help="lr per 512 images")
    ap.add_argument("--layer-decay", type=float, default=0.8)
    ap.add_argument("--wd", type=float, default=1e-8)
    ap.add_argument("--drop-path", type=float, default=0.2)
    ap.add_argument("--ema", type=float, default=0.9999)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--out", default="/nfs/runs/convnext_b_22k_1k_384")
    ap.add_argument("--wandb", action="store_true")
    return ap.parse_args()


def scan_folder(root):
    classes = sorted(d.name for d in os.scandir(root) if d.is_dir())
    samples = []
    for idx, c in enumerate(classes):
        for e in os.scandir(os.path.join(root, c)):
            if e.name.lower().endswith(IMG_EXT):
                samples.append((os.path.join(c, e.name), idx))
    return classes, samples


def load_index(root, cache_path, rank):
    # rank 0 writes the index once; everybody else waits and reads the finished file
    if rank == 0 and not os.path.exists(cache_path):
        classes, samples = scan_folder(root)
        os.makedirs(os.path.dirname(cache_path), exist_ok=True)
        tmp = f"{cache_path}.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            pickle.dump({"root": root, "classes": classes, "samples": samples}, f)
        os.replace(tmp, cache_path)
    dist.barrier()
    with open(cache_path, "rb") as f:
        index = pickle.load(f)
    assert index["root"] == root
    return index["classes"], index["samples"]


class IndexedImages(Dataset):
    def __init__(self, root, samples, transform):
        self.root, self.samples, self.transform = root, samples, transform

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, target = self.samples[i]
        img = Image.open(os.path.join(self.root, path)).convert("RGB")
        return self.transform(img), target


def layer_id(name, max_layer=12):
    if name.startswith("stem"):
        return 0
    if name.startswith("stages."):
        stage = int(name.split(".")[1])
        if ".downsample." in name:
            return {0: 0, 1: 2, 2: 3, 3: max_layer}[stage]
        block = int(name.split(".")[3])
        if stage in (0, 1):
            return stage + 1
        if stage == 2:
            return 3 + block // 3
        return max_layer
    return max_layer + 1


def lrd_groups(model, wd, decay_rate):
    n_layers = 12 + 2
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_wd = p.ndim == 1 or name.endswith(".bias")
        lid = layer_id(name)
        key = (lid, no_wd)
        if key not in groups:
            groups[key] = {"params": [], "weight_decay": 0.0 if no_wd else wd,
                           "lr_scale": decay_rate ** (n_layers - 1 - lid)}
        groups[key]["params"].append(p)
    return list(groups.values())


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    acc = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = net(x)
        top5 = logits.topk(5, dim=1).indices
        acc[0] += (top5[:, 0] == y).sum()
        acc[1] += (top5 == y[:, None]).any(1).sum()
        acc[2] += y.numel()
    dist.all_reduce(acc)
    return (100 * acc[0] / acc[2]).item(), (100 * acc[1] / acc[2]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    main_proc = rank == 0

    train_root = os.path.join(args.data, "train")
    classes, samples = load_index(train_root, args.index_cache, rank)
    train_tf = create_transform(args.img_size, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic")
    val_tf = create_transform(args.img_size, is_training=False, crop_pct=1.0, interpolation="bicubic")
    train_set = IndexedImages(train_root, samples, train_tf)
    val_full = timm.data.ImageDataset(os.path.join(args.data, "val"), transform=val_tf)
    val_set = Subset(val_full, range(rank, len(val_full), world))

    sampler = DistributedSampler(train_set, shuffle=True, seed=42)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=64, num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, num_classes=len(classes), drop_path_rate=args.drop_path)
    sd = torch.load(args.pretrained, map_location="cpu")
    sd = sd.get("model", sd)
    sd = {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}
    for k in [k for k in sd if k.startswith("head.fc.")]:
        sd.pop(k)  # 21841-way head is not used for 1k
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if main_proc:
        print("missing:", missing, "unexpected:", unexpected)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])
    model_without_ddp = model.module
    # EMA copy is taken after DDP has broadcast rank 0's weights (the new head is random per rank)
    ema = ModelEmaV2(model_without_ddp, decay=args.ema)

    lr = args.blr * args.batch_size * args.accum * world / 512
    optimizer = torch.optim.AdamW(lrd_groups(model_without_ddp, args.wd, args.layer_decay), lr=lr)
    for g in optimizer.param_groups:
        g["lr"] = lr * g["lr_scale"]
    updates_per_epoch = len(train_loader) // args.accum
    sched = CosineLRScheduler(optimizer, t_initial=args.epochs * updates_per_epoch, lr_min=1e-6,
                              warmup_t=args.warmup_epochs * updates_per_epoch, t_in_epochs=False)
    scaler = torch.cuda.amp.GradScaler()
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=len(classes))
    criterion = SoftTargetCrossEntropy()

    if main_proc:
        os.makedirs(args.out, exist_ok=True)
        if args.wandb and wandb is not None:
            wandb.init(project="convnext-ft", name=os.path.basename(args.out), config=vars(args))

    best, update = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            last_micro = (i + 1) % args.accum == 0
            with model.no_sync() if not last_micro else nullcontext():
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = criterion(model(x), y) / args.accum
                scaler.scale(loss).backward()
            if last_micro:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                update += 1
                sched.step_update(update)
                ema.update(model_without_ddp)
                if main_proc and update % 100 == 0 and args.wandb and wandb is not None:
                    wandb.log({"loss": loss.item() * args.accum,
                               "lr": optimizer.param_groups[-1]["lr"]}, step=update)

        top1, top5 = evaluate(model_without_ddp, val_loader, device)
        ema1, ema5 = evaluate(ema.module, val_loader, device)
        if main_proc:
            rec = {"epoch": epoch, "top1": top1, "top5": top5, "ema_top1": ema1, "ema_top5": ema5,
                   "epoch_s": time.time() - t0}
            print(json.dumps(rec), flush=True)
            if args.wandb and wandb is not None:
                wandb.log(rec, step=update)
            ckpt = {"model": model_without_ddp.state_dict(), "ema": ema.module.state_dict(),
                    "optimizer": optimizer.state_dict(), "epoch": epoch}
            torch.save(ckpt, os.path.join(args.out, "last.pth"))
            if max(top1, ema1) > best:
                best = max(top1, ema1)
                torch.save(ckpt, os.path.join(args.out, "best.pth"))

    if main_proc and args.wandb and wandb is not None:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
