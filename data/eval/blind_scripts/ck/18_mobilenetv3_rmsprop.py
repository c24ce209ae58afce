"""MobileNetV3-Large ImageNet recipe (timm 'hparams' style).

RMSProp (TF-style eps), step decay 0.973 every 2.4 epochs, 3 warmup epochs,
EMA 0.9999, RandAugment m9, random erasing 0.2, label smoothing 0.1, AMP.
"""
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets

import timm
from timm.data import create_transform, resolve_data_config
from timm.loss import LabelSmoothingCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV2, get_state_dict

logger = logging.getLogger("mnv3")


def get_parser():
    parser = argparse.ArgumentParser("MobileNetV3 training")
    parser.add_argument("--data-dir", default="/data/imagenet")
    parser.add_argument("--output", default="/data/output/mnv3_large")
    parser.add_argument("--model", default="mobilenetv3_large_100")
    parser.add_argument("--batch-size", type=int, default=256, help="per GPU")
    parser.add_argument("--epochs", type=int, default=600)
    parser.add_argument("--lr", type=float, default=0.064, help="for global batch 2048")
    parser.add_argument("--warmup-epochs", type=int, default=3)
    parser.add_argument("--decay-epochs", type=float, default=2.4)
    parser.add_argument("--decay-rate", type=float, default=0.973)
    parser.add_argument("--weight-decay", type=float, default=1e-5)
    parser.add_argument("--drop", type=float, default=0.2)
    parser.add_argument("--drop-path", type=float, default=0.2)
    parser.add_argument("--smoothing", type=float, default=0.1)
    parser.add_argument("--reprob", type=float, default=0.2)
    parser.add_argument("--ema-decay", type=float, default=0.9999)
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--resume", default="")
    return parser


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device)
    criterion = nn.CrossEntropyLoss(reduction="sum")
    for x, y in loader:
        x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        s[0] += criterion(out.float(), y)
        s[1] += (out.argmax(1) == y).sum()
        s[2] += y.numel()
    dist.all_reduce(s)
    return (s[0] / s[2]).item(), (100 * s[1] / s[2]).item()


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(42 + rank)
    torch.backends.cudnn.benchmark = True

    model = timm.create_model(args.model, num_classes=1000, drop_rate=args.drop, drop_path_rate=args.drop_path)
    cfg = resolve_data_config({}, model=model)
    model.to(device, memory_format=torch.channels_last)
    ddp_model = DDP(model, device_ids=[args.local_rank])
    model_ema = ModelEmaV2(model, decay=args.ema_decay)

    lr = args.lr * args.batch_size * world_size / 2048
    optimizer = create_optimizer_v2(model, opt="rmsproptf", lr=lr, weight_decay=args.weight_decay,
                                    eps=0.001, momentum=0.9, alpha=0.9)

    train_tf = create_transform(cfg["input_size"], is_training=True, auto_augment="rand-m9-mstd0.5",
                                re_prob=args.reprob, re_mode="pixel", interpolation="bicubic",
                                mean=cfg["mean"], std=cfg["std"])
    val_tf = create_transform(cfg["input_size"], is_training=False, interpolation=cfg["interpolation"],
                              crop_pct=cfg["crop_pct"], mean=cfg["mean"], std=cfg["std"])
    train_ds = datasets.ImageFolder(os.path.join(args.data_dir, "train"), train_tf)
    val_ds = datasets.ImageFolder(os.path.join(args.data_dir, "val"), val_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world_size)), batch_size=512,
                            num_workers=args.workers, pin_memory=True)

    scheduler, num_epochs = create_scheduler_v2(optimizer, sched="step", num_epochs=args.epochs,
                                                decay_epochs=args.decay_epochs, decay_rate=args.decay_rate,
                                                warmup_epochs=args.warmup_epochs, warmup_lr=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    criterion = LabelSmoothingCrossEntropy(smoothing=args.smoothing)

    start_epoch, best = 0, 0.0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ck["state_dict"])
        model_ema.module.load_state_dict(ck["state_dict_ema"])
        optimizer.load_state_dict(ck["optimizer"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch, best = ck["epoch"] + 1, ck.get("best", 0.0)
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
    logger.info(f"world_size={world_size} lr={lr:.4f} epochs={num_epochs}")

    for epoch in range(start_epoch, num_epochs):
        train_sampler.set_epoch(epoch)
        ddp_model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_loader):
            x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(ddp_model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            model_ema.update(model)
            if it % 200 == 0:
                logger.info(f"epoch {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f} "
                            f"lr {optimizer.param_groups[0]['lr']:.5f}")
        scheduler.step(epoch + 1)

        val_loss, top1 = validate(model, val_loader, device)
        ema_loss, ema_top1 = validate(model_ema.module, val_loader, device)
        logger.info(f"epoch {epoch} ({time.time() - t0:.0f}s): val loss {val_loss:.4f} top1 {top1:.2f} | "
                    f"ema loss {ema_loss:.4f} top1 {ema_top1:.2f}")
        if rank == 0:
            best = max(best, ema_top1)
            torch.save({"epoch": epoch, "state_dict": model.state_dict(), "state_dict_ema": get_state_dict(model_ema),
                        "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "best": best},
                       os.path.join(args.output, "last.pth.tar"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
