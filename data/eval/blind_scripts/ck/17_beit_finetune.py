"""BEiT-B/16 ImageNet-1k fine-tuning (self-supervised checkpoint -> classifier).

Recipe: 100 epochs, AdamW, layer decay 0.65, drop path 0.1, mixup/cutmix,
label smoothing, EMA off, fp16 with dynamic loss scaling. Auto-resumes from
<output_dir>/checkpoint-last.pth if it exists.
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets

import timm
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.utils import NativeScaler


def get_args():
    p = argparse.ArgumentParser("BEiT fine-tuning")
    p.add_argument("--model", default="beit_base_patch16_224")
    p.add_argument("--finetune", default="/shared/pretrain/beit_base_pt_800ep.pth")
    p.add_argument("--data_path", default="/shared/imagenet")
    p.add_argument("--output_dir", default="/shared/exp/beit_b_ft")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--update_freq", type=int, default=1)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--warmup_epochs", type=int, default=20)
    p.add_argument("--blr", type=float, default=5e-4, help="lr per 256 images")
    p.add_argument("--min_lr", type=float, default=1e-6)
    p.add_argument("--layer_decay", type=float, default=0.65)
    p.add_argument("--weight_decay", type=float, default=0.05)
    p.add_argument("--drop_path", type=float, default=0.1)
    p.add_argument("--clip_grad", type=float, default=None)
    p.add_argument("--save_ckpt_freq", type=int, default=20)
    p.add_argument("--num_workers", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def cosine_scheduler(base_value, final_value, epochs, niter_per_ep, warmup_epochs=0, start_warmup_value=0):
    warmup_iters = warmup_epochs * niter_per_ep
    warmup_schedule = np.linspace(start_warmup_value, base_value, warmup_iters)
    iters = np.arange(epochs * niter_per_ep - warmup_iters)
    schedule = final_value + 0.5 * (base_value - final_value) * (1 + np.cos(np.pi * iters / len(iters)))
    schedule = np.concatenate((warmup_schedule, schedule))
    assert len(schedule) == epochs * niter_per_ep
    return schedule


def get_parameter_groups(model, weight_decay, layer_decay):
    num_layers = len(model.blocks) + 1
    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()
    groups = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim == 1 or name.endswith(".bias") or name in skip or "relative_position_bias_table" in name:
            group, wd = "no_decay", 0.0
        else:
            group, wd = "decay", weight_decay
        if name.startswith(("cls_token", "mask_token", "pos_embed", "patch_embed")):
            layer_id = 0
        elif name.startswith("blocks"):
            layer_id = int(name.split(".")[1]) + 1
        else:
            layer_id = num_layers
        key = f"layer_{layer_id}_{group}"
        if key not in groups:
            groups[key] = {"weight_decay": wd, "params": [], "lr_scale": layer_decay ** (num_layers - layer_id)}
        groups[key]["params"].append(param)
    return list(groups.values())


def save_checkpoint(output_dir, tag, epoch, model_without_ddp, optimizer, loss_scaler, args):
    path = os.path.join(output_dir, f"checkpoint-{tag}.pth")
    torch.save({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": loss_scaler.state_dict(), "epoch": epoch, "args": vars(args)}, path)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros((), device=device, dtype=torch.long)
    count = torch.zeros((), device=device, dtype=torch.long)
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(images)
        correct += (output.argmax(-1) == target).sum()
        count += target.numel()
    dist.all_reduce(correct)
    dist.all_reduce(count)
    return 100.0 * correct.item() / count.item()


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    t_train = create_transform(224, is_training=True, color_jitter=0.4, auto_augment="rand-m9-mstd0.5-inc1",
                               interpolation="bicubic", re_prob=0.25, re_mode="pixel", re_count=1)
    t_val = create_transform(224, is_training=False, crop_pct=0.875, interpolation="bicubic")
    dataset_train = datasets.ImageFolder(os.path.join(args.data_path, "train"), t_train)
    dataset_val = datasets.ImageFolder(os.path.join(args.data_path, "val"), t_val)
    sampler_train = DistributedSampler(dataset_train, num_replicas=world, rank=rank, shuffle=True)
    loader_train = DataLoader(dataset_train, sampler=sampler_train, batch_size=args.batch_size,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    loader_val = DataLoader(Subset(dataset_val, range(rank, len(dataset_val), world)),
                            batch_size=int(1.5 * args.batch_size), num_workers=args.num_workers, pin_memory=True)

    model = timm.create_model(args.model, pretrained=False, num_classes=1000, drop_path_rate=args.drop_path,
                              use_abs_pos_emb=False, use_rel_pos_bias=True, init_values=0.1)
    if args.finetune:
        ckpt = torch.load(args.finetune, map_location="cpu")
        state = ckpt.get("model", ckpt)
        state = {k: v for k, v in state.items() if not k.startswith(("head.", "lm_head", "mask_token"))}
        msg = model.load_state_dict(state, strict=False)
        if rank == 0:
            print("loaded pre-trained weights:", msg)
    model.to(device)
    model_without_ddp = model
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])

    total_batch_size = args.batch_size * args.update_freq * world
    args.lr = args.blr * total_batch_size / 256
    num_training_steps_per_epoch = len(loader_train) // args.update_freq
    lr_schedule_values = cosine_scheduler(args.lr, args.min_lr, args.epochs, num_training_steps_per_epoch,
                                          warmup_epochs=args.warmup_epochs)
    optimizer = torch.optim.AdamW(get_parameter_groups(model_without_ddp, args.weight_decay, args.layer_decay),
                                  lr=args.lr)
    loss_scaler = NativeScaler()
    mixup_fn = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    criterion = SoftTargetCrossEntropy()

    os.makedirs(args.output_dir, exist_ok=True)
    start_epoch = 0
    last = os.path.join(args.output_dir, "checkpoint-last.pth")
    if os.path.isfile(last):
        ck = torch.load(last, map_location="cpu")
        model_without_ddp.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        loss_scaler.load_state_dict(ck["scaler"])
        start_epoch = ck["epoch"] + 1
        if rank == 0:
            print(f"auto-resumed from {last} (epoch {ck['epoch']})")

    max_acc = 0.0
    for epoch in range(start_epoch, args.epochs):
        sampler_train.set_epoch(epoch)
        model.train()
        optimizer.zero_grad()
        t0 = time.time()
        for data_iter_step, (samples, targets) in enumerate(loader_train):
            step = data_iter_step // args.update_freq
            it = min(epoch * num_training_steps_per_epoch + step, len(lr_schedule_values) - 1)
            if data_iter_step % args.update_freq == 0:
                for g in optimizer.param_groups:
                    g["lr"] = lr_schedule_values[it] * g["lr_scale"]
            samples, targets = samples.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            samples, targets = mixup_fn(samples, targets)
            with torch.cuda.amp.autocast():
                loss = criterion(model(samples), targets)
            loss_scaler(loss / args.update_freq, optimizer, clip_grad=args.clip_grad,
                        parameters=model.parameters(), need_update=(data_iter_step + 1) % args.update_freq == 0)
            if (data_iter_step + 1) % args.update_freq == 0:
                optimizer.zero_grad()
            if rank == 0 and data_iter_step % 100 == 0:
                print(f"Epoch [{epoch}] [{data_iter_step}/{len(loader_train)}] loss {loss.item():.4f} "
                      f"lr {optimizer.param_groups[-1]['lr']:.2e}")

        save_checkpoint(args.output_dir, "last", epoch, model_without_ddp, optimizer, loss_scaler, args)
        if (epoch + 1) % args.save_ckpt_freq == 0 or epoch + 1 == args.epochs:
            save_checkpoint(args.output_dir, str(epoch), epoch, model_without_ddp, optimizer, loss_scaler, args)

        acc = evaluate(model_without_ddp, loader_val, device)
        max_acc = max(max_acc, acc)
        if rank == 0:
            print(f"epoch {epoch}: acc1 {acc:.2f} (max {max_acc:.2f}) in {time.time() - t0:.0f}s")
            with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "acc1": acc, "max_acc1": max_acc}) + "\n")

    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args())
