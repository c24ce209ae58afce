#!/usr/bin/env python3
"""Two-stage ViT-B/16 recipe in one script.

  --stage pretrain : ImageNet-21k (fall11, 21843 classes), 90 epochs, 224px
  --stage finetune : ImageNet-1k, 20 epochs, 384px, initialised from the pretrain checkpoint

    torchrun --nproc_per_node 8 20_vit_21k_then_1k.py --stage pretrain --data /data/in21k
    torchrun --nproc_per_node 8 20_vit_21k_then_1k.py --stage finetune --data /data/in1k \
        --init runs/vit_b16/pretrain/last.pth
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets

import timm
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV2

STAGES = {
    "pretrain": dict(img_size=224, num_classes=21843, epochs=90, lr=1e-3, ref_batch=4096, wd=0.1,
                     warmup=10, mixup=0.5, cutmix=0.0, smoothing=0.0, drop_path=0.1, layer_decay=None),
    "finetune": dict(img_size=384, num_classes=1000, epochs=20, lr=5e-5, ref_batch=512, wd=1e-8,
                     warmup=2, mixup=0.8, cutmix=1.0, smoothing=0.1, drop_path=0.1, layer_decay=0.75),
}


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", choices=list(STAGES), required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--init", default="", help="pretrain checkpoint for --stage finetune")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--out", default="runs/vit_b16")
    return ap.parse_args()


def resize_pos_embed(pos, new_len, num_prefix=1):
    prefix, grid = pos[:, :num_prefix], pos[:, num_prefix:]
    old = int(grid.shape[1] ** 0.5)
    new = int((new_len - num_prefix) ** 0.5)
    if old == new:
        return pos
    grid = grid.reshape(1, old, old, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=(new, new), mode="bicubic", align_corners=False)
    return torch.cat([prefix, grid.permute(0, 2, 3, 1).reshape(1, new * new, -1)], dim=1)


def init_from_pretrain(model, path, rank):
    sd = torch.load(path, map_location="cpu")["model"]
    sd = {k: v for k, v in sd.items() if not k.startswith("head.")}
    if "pos_embed" in sd:
        sd["pos_embed"] = resize_pos_embed(sd["pos_embed"], model.pos_embed.shape[1])
    msg = model.load_state_dict(sd, strict=False)
    if rank == 0:
        print(f"init from {path}: {len(msg.missing_keys)} missing, {len(msg.unexpected_keys)} unexpected")


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            acc[0] += (model(x).argmax(-1) == y).sum()
        acc[1] += y.numel()
    dist.all_reduce(acc)
    return (100 * acc[0] / acc[1]).item()


def main():
    args = parse()
    cfg = STAGES[args.stage]
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(rank)
    out_dir = os.path.join(args.out, args.stage)

    tf_train = create_transform(cfg["img_size"], is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                interpolation="bicubic")
    tf_val = create_transform(cfg["img_size"], is_training=False, crop_pct=1.0 if cfg["img_size"] > 224 else 0.875,
                              interpolation="bicubic")
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), tf_train)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), tf_val)
    assert len(train_set.classes) == cfg["num_classes"]
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=128,
                            num_workers=args.workers, pin_memory=True)

    model = timm.create_model("vit_base_patch16_224", img_size=cfg["img_size"], num_classes=cfg["num_classes"],
                              drop_path_rate=cfg["drop_path"])
    if args.stage == "finetune":
        assert args.init, "--init is required for fine-tuning"
        init_from_pretrain(model, args.init, rank)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])
    ema = ModelEmaV2(model.module, decay=0.9999)

    lr = cfg["lr"] * args.batch_size * world / cfg["ref_batch"]
    optimizer = create_optimizer_v2(model.module, opt="adamw", lr=lr, weight_decay=cfg["wd"],
                                    layer_decay=cfg["layer_decay"])
    n_iter = len(train_loader)
    scheduler = CosineLRScheduler(optimizer, t_initial=cfg["epochs"] * n_iter, lr_min=1e-6,
                                  warmup_t=cfg["warmup"] * n_iter, warmup_lr_init=1e-7, t_in_epochs=False)
    mixup = Mixup(mixup_alpha=cfg["mixup"], cutmix_alpha=cfg["cutmix"], label_smoothing=cfg["smoothing"],
                  num_classes=cfg["num_classes"])
    criterion = SoftTargetCrossEntropy()
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    last = os.path.join(out_dir, "last.pth")
    if os.path.exists(last):
        ckpt = torch.load(last, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        ema.module.load_state_dict(ckpt["ema"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        print(f"[{args.stage}] world {world} lr {lr:.2e} iters/epoch {n_iter} start {start_epoch}", flush=True)

    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step_update(epoch * n_iter + i + 1)
            ema.update(model.module)
            if rank == 0 and i % 200 == 0:
                print(f"[{args.stage}] ep {epoch} {i}/{n_iter} loss {loss.item():.4f}", flush=True)

        top1 = evaluate(model.module, val_loader, device)
        ema_top1 = evaluate(ema.module, val_loader, device)
        if rank == 0:
            rec = {"stage": args.stage, "epoch": epoch, "top1": top1, "ema_top1": ema_top1,
                   "minutes": (time.time() - t0) / 60}
            print(json.dumps(rec), flush=True)
            with open(os.path.join(out_dir, "log.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
            torch.save({"model": model.state_dict(), "ema": ema.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch},
                       last + ".tmp")
            os.replace(last + ".tmp", last)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
