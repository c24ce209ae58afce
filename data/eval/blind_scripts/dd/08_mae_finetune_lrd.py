# End-to-end fine-tuning of an MAE / BEiT pre-trained ViT-B with layer-wise lr decay, mixup and EMA-free AdamW.
import argparse
import json
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision import datasets, transforms


def get_args():
    parser = argparse.ArgumentParser("MAE fine-tuning for image classification")
    parser.add_argument("--batch_size", default=32, type=int, help="per GPU")
    parser.add_argument("--accum_iter", default=4, type=int)
    parser.add_argument("--epochs", default=100, type=int)
    parser.add_argument("--model", default="vit_base_patch16_224", type=str)
    parser.add_argument("--drop_path", type=float, default=0.1)
    parser.add_argument("--clip_grad", type=float, default=None)
    parser.add_argument("--weight_decay", type=float, default=0.05)
    parser.add_argument("--blr", type=float, default=5e-4)
    parser.add_argument("--layer_decay", type=float, default=0.65)
    parser.add_argument("--min_lr", type=float, default=1e-6)
    parser.add_argument("--warmup_epochs", type=int, default=5)
    parser.add_argument("--smoothing", type=float, default=0.1)
    parser.add_argument("--mixup", type=float, default=0.8)
    parser.add_argument("--cutmix", type=float, default=1.0)
    parser.add_argument("--finetune", default="", help="pre-trained checkpoint")
    parser.add_argument("--global_pool", action="store_true", default=True)
    parser.add_argument("--data_path", default="/datasets/imagenet", type=str)
    parser.add_argument("--nb_classes", default=1000, type=int)
    parser.add_argument("--output_dir", default="./output_finetune")
    parser.add_argument("--resume", default="")
    parser.add_argument("--num_workers", default=10, type=int)
    parser.add_argument("--seed", default=0, type=int)
    return parser.parse_args()


def get_layer_id_for_vit(name, num_layers):
    if name in ("cls_token", "pos_embed"):
        return 0
    elif name.startswith("patch_embed"):
        return 0
    elif name.startswith("blocks"):
        return int(name.split(".")[1]) + 1
    return num_layers


def param_groups_lrd(model, weight_decay=0.05, no_weight_decay_list=(), layer_decay=0.75):
    param_group_names, param_groups = {}, {}
    num_layers = len(model.blocks) + 1
    layer_scales = list(layer_decay ** (num_layers - i) for i in range(num_layers + 1))
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim == 1 or n in no_weight_decay_list:
            g_decay, this_decay = "no_decay", 0.0
        else:
            g_decay, this_decay = "decay", weight_decay
        layer_id = get_layer_id_for_vit(n, num_layers)
        group_name = f"layer_{layer_id}_{g_decay}"
        if group_name not in param_group_names:
            this_scale = layer_scales[layer_id]
            param_group_names[group_name] = {"lr_scale": this_scale, "weight_decay": this_decay, "params": []}
            param_groups[group_name] = {"lr_scale": this_scale, "weight_decay": this_decay, "params": []}
        param_group_names[group_name]["params"].append(n)
        param_groups[group_name]["params"].append(p)
    return list(param_groups.values())


def adjust_learning_rate(optimizer, epoch, args):
    if epoch < args.warmup_epochs:
        lr = args.lr * epoch / args.warmup_epochs
    else:
        lr = args.min_lr + (args.lr - args.min_lr) * 0.5 * \
            (1. + math.cos(math.pi * (epoch - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
    return lr


class EvalShardSampler(torch.utils.data.Sampler):
    """Every rank gets indices rank, rank + world, ...; no padding, so each val image is counted once."""

    def __init__(self, dataset, rank, world_size):
        self.indices = list(range(rank, len(dataset), world_size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(4, device=device, dtype=torch.float64)
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(images)
            loss = nn.functional.cross_entropy(output, target, reduction="sum")
        top5 = output.topk(5, dim=1).indices
        stats[0] += (top5[:, 0] == target).sum()
        stats[1] += (top5 == target[:, None]).any(dim=1).sum()
        stats[2] += loss.float()
        stats[3] += target.numel()
    dist.all_reduce(stats)
    return {"acc1": (100 * stats[0] / stats[3]).item(), "acc5": (100 * stats[1] / stats[3]).item(),
            "loss": (stats[2] / stats[3]).item()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed + rank)

    train_tf = create_transform(224, is_training=True, color_jitter=None, auto_augment="rand-m9-mstd0.5-inc1",
                                interpolation="bicubic", re_prob=0.25, re_mode="pixel", re_count=1)
    val_tf = transforms.Compose([transforms.Resize(256, interpolation=3), transforms.CenterCrop(224),
                                 transforms.ToTensor(),
                                 transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    ds_train = datasets.ImageFolder(os.path.join(args.data_path, "train"), transform=train_tf)
    ds_val = datasets.ImageFolder(os.path.join(args.data_path, "val"), transform=val_tf)
    sampler_train = torch.utils.data.DistributedSampler(ds_train, shuffle=True)
    loader_train = torch.utils.data.DataLoader(ds_train, sampler=sampler_train, batch_size=args.batch_size,
                                               num_workers=args.num_workers, pin_memory=True, drop_last=True)
    loader_val = torch.utils.data.DataLoader(ds_val, sampler=EvalShardSampler(ds_val, rank, world_size),
                                             batch_size=int(1.5 * args.batch_size), num_workers=args.num_workers,
                                             pin_memory=True, drop_last=False)

    mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                     num_classes=args.nb_classes)

    model = timm.create_model(args.model, num_classes=args.nb_classes, drop_path_rate=args.drop_path,
                              global_pool="avg" if args.global_pool else "token")
    if args.finetune:
        ckpt = torch.load(args.finetune, map_location="cpu")
        sd = ckpt.get("model", ckpt)
        sd = {k: v for k, v in sd.items() if not k.startswith(("decoder", "mask_token", "head."))}
        if args.global_pool:
            sd = {k: v for k, v in sd.items() if not k.startswith("norm.")}
        msg = model.load_state_dict(sd, strict=False)
        if rank == 0:
            print(msg)
        nn.init.trunc_normal_(model.head.weight, std=2e-5)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])
    model_without_ddp = model.module

    eff_batch_size = args.batch_size * args.accum_iter * world_size
    args.lr = args.blr * eff_batch_size / 256
    param_groups = param_groups_lrd(model, args.weight_decay,
                                    no_weight_decay_list=model.no_weight_decay(),
                                    layer_decay=args.layer_decay)
    optimizer = torch.optim.AdamW(param_groups, lr=args.lr)
    scaler = torch.cuda.amp.GradScaler()
    criterion = SoftTargetCrossEntropy()

    start_epoch, max_acc = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, max_acc = ckpt["epoch"] + 1, ckpt.get("max_acc", 0.0)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"lr {args.lr:.2e}, eff batch {eff_batch_size}, {len(param_groups)} param groups")

    for epoch in range(start_epoch, args.epochs):
        sampler_train.set_epoch(epoch)
        model.train()
        optimizer.zero_grad()
        t0 = time.time()
        n = len(loader_train)
        for it, (samples, targets) in enumerate(loader_train):
            if it % args.accum_iter == 0:
                adjust_learning_rate(optimizer, it / n + epoch, args)
            samples = samples.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            samples, targets = mixup_fn(samples, targets)
            update = (it + 1) % args.accum_iter == 0
            with torch.cuda.amp.autocast():
                loss = criterion(model(samples), targets) / args.accum_iter
            scaler.scale(loss).backward()
            if update:
                if args.clip_grad is not None:
                    scaler.unscale_(optimizer)
                    nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
            if rank == 0 and it % 200 == 0:
                print(f"ep {epoch} [{it}/{n}] loss {loss.item() * args.accum_iter:.4f}")

        test_stats = evaluate(model_without_ddp, loader_val, device)
        max_acc = max(max_acc, test_stats["acc1"])
        if rank == 0:
            print(f"epoch {epoch} acc1 {test_stats['acc1']:.2f} (max {max_acc:.2f}) time {time.time() - t0:.0f}s")
            with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
                f.write(json.dumps({"epoch": epoch, **test_stats}) + "\n")
            torch.save({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch, "max_acc": max_acc},
                       os.path.join(args.output_dir, "checkpoint-last.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
