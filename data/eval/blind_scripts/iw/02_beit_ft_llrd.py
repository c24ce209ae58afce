#!/usr/bin/env python3
"""Fine-tune a BEiT / ViT checkpoint (pre-trained on ImageNet-21k) on ImageNet-1k.

Layer-wise lr decay, mixup/cutmix, drop path, EMA. Launch with torchrun.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision import datasets

import timm
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV2, accuracy


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/imagenet")
    p.add_argument("--model", default="beit_base_patch16_224.in22k_ft_in22k")
    p.add_argument("--finetune", default="", help="path to a pre-trained checkpoint")
    p.add_argument("--nb-classes", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--accum-iter", type=int, default=1)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--blr", type=float, default=5e-4, help="lr = blr * eff_batch / 256")
    p.add_argument("--min-lr", type=float, default=1e-6)
    p.add_argument("--layer-decay", type=float, default=0.65)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--drop-path", type=float, default=0.1)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--mixup", type=float, default=0.8)
    p.add_argument("--cutmix", type=float, default=1.0)
    p.add_argument("--ema-decay", type=float, default=0.9999)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--output-dir", default="./ft_out")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def layer_id_for(name, num_layers):
    if name in ("cls_token", "pos_embed", "mask_token") or name.startswith("patch_embed"):
        return 0
    if name.startswith("rel_pos_bias"):
        return num_layers - 1
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return num_layers - 1


def param_groups_lrd(model, weight_decay, no_weight_decay_list, layer_decay):
    """Parameter groups with layer-wise lr decay (BEiT / MAE style)."""
    num_layers = len(model.blocks) + 1
    scales = [layer_decay ** (num_layers - i) for i in range(num_layers + 1)]
    groups = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim == 1 or n in no_weight_decay_list or n.endswith(".bias"):
            g_decay, this_wd = "no_decay", 0.0
        else:
            g_decay, this_wd = "decay", weight_decay
        layer_id = layer_id_for(n, num_layers + 1)
        key = f"layer_{layer_id}_{g_decay}"
        if key not in groups:
            groups[key] = {"lr_scale": scales[layer_id], "weight_decay": this_wd, "params": []}
        groups[key]["params"].append(p)
    return list(groups.values())


def load_pretrained(model, path, is_main):
    ckpt = torch.load(path, map_location="cpu")
    state = ckpt.get("model", ckpt.get("module", ckpt))
    state = {k.replace("module.", "", 1) if k.startswith("module.") else k: v for k, v in state.items()}
    own = model.state_dict()
    for k in ("head.weight", "head.bias"):
        if k in state and state[k].shape != own[k].shape:
            if is_main:
                print(f"dropping {k} {tuple(state[k].shape)} from checkpoint")
            del state[k]
    msg = model.load_state_dict(state, strict=False)
    if is_main:
        print(msg)
    torch.nn.init.trunc_normal_(model.head.weight, std=2e-5)
    torch.nn.init.zeros_(model.head.bias)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    totals = torch.zeros(3, device=device, dtype=torch.float64)
    for images, target in loader:
        images = images.cuda(device, non_blocking=True)
        target = target.cuda(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            output = model(images)
        acc1, acc5 = accuracy(output.float(), target, topk=(1, 5))
        totals[0] += acc1.double() * target.size(0) / 100
        totals[1] += acc5.double() * target.size(0) / 100
        totals[2] += target.size(0)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return (100 * totals[0] / totals[2]).item(), (100 * totals[1] / totals[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    is_main = rank == 0
    torch.manual_seed(args.seed + rank)

    train_tf = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic")
    val_tf = create_transform(224, is_training=False, crop_pct=0.875, interpolation="bicubic")
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)

    train_sampler = torch.utils.data.DistributedSampler(train_set, num_replicas=world_size,
                                                        rank=rank, shuffle=True, seed=args.seed)
    val_subset = torch.utils.data.Subset(val_set, list(range(rank, len(val_set), world_size)))
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size,
                                               sampler=train_sampler, num_workers=args.workers,
                                               pin_memory=True, drop_last=True)
    val_loader = torch.utils.data.DataLoader(val_subset, batch_size=2 * args.batch_size,
                                             num_workers=args.workers, pin_memory=True)

    mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, prob=1.0,
                     switch_prob=0.5, mode="batch", label_smoothing=args.smoothing,
                     num_classes=args.nb_classes)

    model = timm.create_model(args.model, pretrained=False, num_classes=args.nb_classes,
                              drop_path_rate=args.drop_path)
    if args.finetune:
        load_pretrained(model, args.finetune, is_main)
    model.cuda(device)

    model = DDP(model, device_ids=[local_rank])
    model_without_ddp = model.module
    model_ema = ModelEmaV2(model_without_ddp, decay=args.ema_decay)

    eff_batch = args.batch_size * args.accum_iter * world_size
    lr = args.blr * eff_batch / 256
    if is_main:
        print(f"base lr {args.blr:.2e} -> actual lr {lr:.2e} (effective batch {eff_batch})")

    param_groups = param_groups_lrd(model, args.weight_decay,
                                    no_weight_decay_list=model_without_ddp.no_weight_decay(),
                                    layer_decay=args.layer_decay)
    optimizer = torch.optim.AdamW(param_groups, lr=lr, betas=(0.9, 0.999))
    for g in optimizer.param_groups:
        g["lr"] = lr * g["lr_scale"]
    scaler = torch.cuda.amp.GradScaler()

    steps_per_epoch = len(train_loader) // args.accum_iter
    sched = CosineLRScheduler(optimizer, t_initial=args.epochs * steps_per_epoch, lr_min=args.min_lr,
                              warmup_t=args.warmup_epochs * steps_per_epoch, warmup_lr_init=1e-7,
                              t_in_epochs=False)
    criterion = SoftTargetCrossEntropy()

    if is_main:
        os.makedirs(args.output_dir, exist_ok=True)

    best = 0.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        optimizer.zero_grad(set_to_none=True)
        for it, (x, y) in enumerate(train_loader):
            x = x.cuda(device, non_blocking=True)
            y = y.cuda(device, non_blocking=True)
            x, y = mixup_fn(x, y)
            with torch.cuda.amp.autocast():
                loss = criterion(model(x), y) / args.accum_iter
            scaler.scale(loss).backward()
            if (it + 1) % args.accum_iter == 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                sched.step_update(step)  # per-group base lr already includes lr_scale
                model_ema.update(model_without_ddp)
            if is_main and it % 200 == 0:
                print(f"ep {epoch} it {it} loss {loss.item() * args.accum_iter:.4f}", flush=True)

        acc1, acc5 = evaluate(model_without_ddp, val_loader, device)
        ema1, _ = evaluate(model_ema.module, val_loader, device)
        if is_main:
            print(f"ep {epoch} top1 {acc1:.2f} top5 {acc5:.2f} ema top1 {ema1:.2f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            state = {"model": model_without_ddp.state_dict(), "ema": model_ema.module.state_dict(),
                     "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch}
            torch.save(state, os.path.join(args.output_dir, "checkpoint-last.pth"))
            if max(acc1, ema1) > best:
                best = max(acc1, ema1)
                torch.save(state, os.path.join(args.output_dir, "checkpoint-best.pth"))
            with open(os.path.join(args.output_dir, "log.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "acc1": acc1, "acc5": acc5, "ema_acc1": ema1}) + "\n")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
