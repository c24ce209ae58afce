#!/usr/bin/env python3
"""ConvNeXt V2-L fine-tuning on ImageNet-1k (FCMAE pre-trained, then 22k intermediate FT).

Layer-wise lr decay, EMA, mixup/cutmix, auto-resume from the output directory so the job
can be requeued by the scheduler.
"""
import argparse
import glob
import json
import os
import re
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets

import timm
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV3, NativeScaler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-path", default="/data/imagenet-1k")
    ap.add_argument("--model", default="convnextv2_large")
    ap.add_argument("--finetune", default="/models/convnextv2_large_22k_224_ema.pt")
    ap.add_argument("--input-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--update-freq", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--blr", type=float, default=6.25e-5, help="lr = blr * total_batch / 256")
    ap.add_argument("--layer-decay", type=float, default=0.8)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--drop-path", type=float, default=0.3)
    ap.add_argument("--model-ema-decay", type=float, default=0.9999)
    ap.add_argument("--save-ckpt-freq", type=int, default=1)
    ap.add_argument("--keep", type=int, default=2, help="number of epoch checkpoints to keep")
    ap.add_argument("--num-workers", type=int, default=10)
    ap.add_argument("--output-dir", default="/checkpoints/convnextv2_l_ft_1k")
    return ap.parse_args()


def save_checkpoint(args, epoch, model_without_ddp, model_ema, optimizer, loss_scaler, max_acc):
    path = os.path.join(args.output_dir, f"checkpoint-{epoch}.pth")
    torch.save({"model": model_without_ddp.state_dict(),
                "model_ema": model_ema.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": loss_scaler.state_dict(),
                "epoch": epoch, "max_accuracy": max_acc, "args": vars(args)}, path)
    old = sorted(glob.glob(os.path.join(args.output_dir, "checkpoint-*.pth")),
                 key=lambda p: int(re.findall(r"checkpoint-(\d+)\.pth", p)[0]))
    for p in old[:-args.keep]:
        os.remove(p)


def auto_resume(args, model_without_ddp, model_ema, optimizer, loss_scaler):
    ckpts = glob.glob(os.path.join(args.output_dir, "checkpoint-*.pth"))
    if not ckpts:
        return 0, 0.0
    latest = max(ckpts, key=lambda p: int(re.findall(r"checkpoint-(\d+)\.pth", p)[0]))
    ckpt = torch.load(latest, map_location="cpu")
    model_without_ddp.load_state_dict(ckpt["model"])
    model_ema.module.load_state_dict(ckpt["model_ema"])
    optimizer.load_state_dict(ckpt["optimizer"])
    loss_scaler.load_state_dict(ckpt["scaler"])
    print(f"auto-resumed from {latest}")
    return ckpt["epoch"] + 1, ckpt["max_accuracy"]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    res = torch.zeros(3, dtype=torch.float64, device=device)
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(images)
        top5 = out.topk(5, dim=-1).indices
        res[0] += (top5[:, 0] == target).sum()
        res[1] += (top5 == target.unsqueeze(-1)).any(-1).sum()
        res[2] += target.numel()
    dist.all_reduce(res)
    return {"acc1": (100 * res[0] / res[2]).item(), "acc5": (100 * res[1] / res[2]).item()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1 + rank)
    os.makedirs(args.output_dir, exist_ok=True)

    tf_train = create_transform(args.input_size, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic")
    tf_val = create_transform(args.input_size, is_training=False, crop_pct=0.875, interpolation="bicubic")
    ds_train = datasets.ImageFolder(os.path.join(args.data_path, "train"), tf_train)
    ds_val = datasets.ImageFolder(os.path.join(args.data_path, "val"), tf_val)
    sampler_train = DistributedSampler(ds_train, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    dl_train = DataLoader(ds_train, sampler=sampler_train, batch_size=args.batch_size,
                          num_workers=args.num_workers, pin_memory=True, drop_last=True)
    dl_val = DataLoader(Subset(ds_val, range(rank, len(ds_val), world_size)), batch_size=64,
                        num_workers=args.num_workers, pin_memory=True)

    model = timm.create_model(args.model, num_classes=1000, drop_path_rate=args.drop_path)
    if args.finetune:
        sd = torch.load(args.finetune, map_location="cpu")
        sd = {k: v for k, v in sd.items() if not k.startswith("head.fc.")}
        msg = model.load_state_dict(sd, strict=False)
        if rank == 0:
            print(msg)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])
    model_without_ddp = model.module
    model_ema = ModelEmaV3(model_without_ddp, decay=args.model_ema_decay)

    total_batch = args.batch_size * args.update_freq * world_size
    lr = args.blr * total_batch / 256
    optimizer = create_optimizer_v2(model_without_ddp, opt="adamw", lr=lr,
                                    weight_decay=args.weight_decay, layer_decay=args.layer_decay)
    loss_scaler = NativeScaler()
    updates = len(dl_train) // args.update_freq
    scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs * updates, lr_min=1e-6,
                                  warmup_t=args.warmup_epochs * updates, warmup_lr_init=1e-7, t_in_epochs=False)
    mixup_fn = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    criterion = SoftTargetCrossEntropy()

    start_epoch, max_accuracy = auto_resume(args, model_without_ddp, model_ema, optimizer, loss_scaler)

    for epoch in range(start_epoch, args.epochs):
        sampler_train.set_epoch(epoch)
        model.train()
        optimizer.zero_grad()
        t0 = time.time()
        num_updates = epoch * updates
        for it, (samples, targets) in enumerate(dl_train):
            samples, targets = samples.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            samples, targets = mixup_fn(samples, targets)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(samples), targets) / args.update_freq
            step_now = (it + 1) % args.update_freq == 0
            loss_scaler(loss, optimizer, clip_grad=None, parameters=model.parameters(),
                        need_update=step_now)
            if step_now:
                optimizer.zero_grad()
                num_updates += 1
                scheduler.step_update(num_updates)
                model_ema.update(model_without_ddp, step=num_updates)
            if rank == 0 and it % 200 == 0:
                print(f"epoch {epoch} it {it} loss {loss.item() * args.update_freq:.4f}", flush=True)

        stats = evaluate(model_without_ddp, dl_val, device)
        ema_stats = evaluate(model_ema.module, dl_val, device)
        max_accuracy = max(max_accuracy, stats["acc1"], ema_stats["acc1"])

        if (epoch + 1) % args.save_ckpt_freq == 0 or epoch + 1 == args.epochs:
            save_checkpoint(args, epoch, model_without_ddp, model_ema, optimizer, loss_scaler, max_accuracy)

        if rank == 0:
            rec = {"epoch": epoch, **{f"test_{k}": v for k, v in stats.items()},
                   **{f"ema_{k}": v for k, v in ema_stats.items()}, "max_accuracy": max_accuracy,
                   "epoch_time": time.time() - t0}
            print(json.dumps(rec), flush=True)
            with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
                f.write(json.dumps(rec) + "\n")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
