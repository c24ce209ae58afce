# Fine-tune a self-supervised ViT-B/16 (MAE pre-training) on ImageNet-1k.
# MAE-style recipe: layer-wise lr decay 0.65, half-cycle cosine per iteration,
# mixup/cutmix, label smoothing, drop path, AMP.
import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms

import timm
from timm.data import Mixup, create_transform
from timm.layers import trunc_normal_
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.utils import NativeScaler


def get_args():
    parser = argparse.ArgumentParser("MAE fine-tuning for image classification")
    parser.add_argument("--batch_size", default=64, type=int, help="batch size per GPU")
    parser.add_argument("--epochs", default=100, type=int)
    parser.add_argument("--accum_iter", default=1, type=int)
    parser.add_argument("--model", default="vit_base_patch16_224", type=str)
    parser.add_argument("--input_size", default=224, type=int)
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
    parser.add_argument("--finetune", default="", help="MAE pre-trained checkpoint")
    parser.add_argument("--global_pool", action="store_true", default=True)
    parser.add_argument("--data_path", default="/datasets01/imagenet_full_size/061417/", type=str)
    parser.add_argument("--nb_classes", default=1000, type=int)
    parser.add_argument("--output_dir", default="./output_dir")
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--num_workers", default=10, type=int)
    return parser.parse_args()


def get_layer_id_for_vit(name, num_layers):
    if name in ["cls_token", "pos_embed"]:
        return 0
    elif name.startswith("patch_embed"):
        return 0
    elif name.startswith("blocks"):
        return int(name.split(".")[1]) + 1
    else:
        return num_layers


def param_groups_lrd(model, weight_decay=0.05, no_weight_decay_list=(), layer_decay=0.75):
    param_group_names = {}
    param_groups = {}
    num_layers = len(model.blocks) + 1
    layer_scales = [layer_decay ** (num_layers - i) for i in range(num_layers + 1)]
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
    """Decay the learning rate with half-cycle cosine after warmup."""
    if epoch < args.warmup_epochs:
        lr = args.lr * epoch / args.warmup_epochs
    else:
        lr = args.min_lr + (args.lr - args.min_lr) * 0.5 * (
            1.0 + math.cos(math.pi * (epoch - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr * param_group.get("lr_scale", 1.0)
    return lr


def interpolate_pos_embed(model, checkpoint_model):
    if "pos_embed" not in checkpoint_model:
        return
    pos_embed_checkpoint = checkpoint_model["pos_embed"]
    embedding_size = pos_embed_checkpoint.shape[-1]
    num_patches = model.patch_embed.num_patches
    num_extra_tokens = model.pos_embed.shape[-2] - num_patches
    orig_size = int((pos_embed_checkpoint.shape[-2] - num_extra_tokens) ** 0.5)
    new_size = int(num_patches ** 0.5)
    if orig_size != new_size:
        extra_tokens = pos_embed_checkpoint[:, :num_extra_tokens]
        pos_tokens = pos_embed_checkpoint[:, num_extra_tokens:]
        pos_tokens = pos_tokens.reshape(-1, orig_size, orig_size, embedding_size).permute(0, 3, 1, 2)
        pos_tokens = F.interpolate(pos_tokens, size=(new_size, new_size), mode="bicubic", align_corners=False)
        pos_tokens = pos_tokens.permute(0, 2, 3, 1).flatten(1, 2)
        checkpoint_model["pos_embed"] = torch.cat((extra_tokens, pos_tokens), dim=1)


def build_dataset(is_train, args):
    if is_train:
        transform = create_transform(input_size=args.input_size, is_training=True, color_jitter=None,
                                     auto_augment="rand-m9-mstd0.5-inc1", interpolation="bicubic",
                                     re_prob=0.25, re_mode="pixel", re_count=1)
    else:
        transform = transforms.Compose([
            transforms.Resize(256, interpolation=transforms.InterpolationMode.BICUBIC),
            transforms.CenterCrop(args.input_size),
            transforms.ToTensor(),
            transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ])
    root = os.path.join(args.data_path, "train" if is_train else "val")
    return datasets.ImageFolder(root, transform=transform)


@torch.no_grad()
def evaluate(loader, model, device):
    model.eval()
    acc = torch.zeros(3, dtype=torch.float64, device=device)
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(images)
        top5 = output.topk(5, dim=1).indices
        acc[0] += (top5[:, 0] == target).sum()
        acc[1] += (top5 == target[:, None]).any(dim=1).sum()
        acc[2] += images.shape[0]
    dist.all_reduce(acc, op=dist.ReduceOp.SUM)
    return {"acc1": (100 * acc[0] / acc[2]).item(), "acc5": (100 * acc[1] / acc[2]).item()}


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda")

    seed = args.seed + rank
    torch.manual_seed(seed)
    np.random.seed(seed)

    dataset_train = build_dataset(True, args)
    dataset_val = build_dataset(False, args)
    sampler_train = DistributedSampler(dataset_train, num_replicas=world_size, rank=rank, shuffle=True)
    data_loader_train = DataLoader(dataset_train, sampler=sampler_train, batch_size=args.batch_size,
                                   num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_part = Subset(dataset_val, np.arange(rank, len(dataset_val), world_size).tolist())
    data_loader_val = DataLoader(val_part, batch_size=args.batch_size, shuffle=False,
                                 num_workers=args.num_workers, pin_memory=True, drop_last=False)

    mixup_fn = None
    if args.mixup > 0 or args.cutmix > 0:
        mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                         num_classes=args.nb_classes)

    model = timm.create_model(args.model, num_classes=args.nb_classes, drop_path_rate=args.drop_path,
                              global_pool="avg" if args.global_pool else "token")
    if args.finetune:
        checkpoint = torch.load(args.finetune, map_location="cpu")
        checkpoint_model = checkpoint["model"]
        state_dict = model.state_dict()
        for k in ["head.weight", "head.bias"]:
            if k in checkpoint_model and checkpoint_model[k].shape != state_dict[k].shape:
                del checkpoint_model[k]
        interpolate_pos_embed(model, checkpoint_model)
        msg = model.load_state_dict(checkpoint_model, strict=False)
        if rank == 0:
            print(msg)
        trunc_normal_(model.head.weight, std=2e-5)
    model.to(device)

    model_without_ddp = model
    model = DistributedDataParallel(model, device_ids=[local_rank])
    model_without_ddp = model.module

    eff_batch_size = args.batch_size * args.accum_iter * world_size
    args.lr = args.blr * eff_batch_size / 256
    if rank == 0:
        print(f"base lr: {args.blr:.2e}  actual lr: {args.lr:.2e}  effective batch: {eff_batch_size}")

    param_groups = param_groups_lrd(model_without_ddp, args.weight_decay,
                                    no_weight_decay_list=model.no_weight_decay(),
                                    layer_decay=args.layer_decay)
    optimizer = torch.optim.AdamW(param_groups, lr=args.lr)
    loss_scaler = NativeScaler()
    criterion = SoftTargetCrossEntropy() if mixup_fn is not None else LabelSmoothingCrossEntropy(args.smoothing)

    out = Path(args.output_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    max_accuracy = 0.0
    start_time = time.time()
    for epoch in range(args.epochs):
        sampler_train.set_epoch(epoch)
        model.train(True)
        optimizer.zero_grad()
        for data_iter_step, (samples, targets) in enumerate(data_loader_train):
            if data_iter_step % args.accum_iter == 0:
                adjust_learning_rate(optimizer, data_iter_step / len(data_loader_train) + epoch, args)
            samples = samples.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            if mixup_fn is not None:
                samples, targets = mixup_fn(samples, targets)
            with torch.cuda.amp.autocast():
                outputs = model(samples)
                loss = criterion(outputs, targets)
            loss_value = loss.item()
            loss = loss / args.accum_iter
            loss_scaler(loss, optimizer, clip_grad=args.clip_grad, parameters=model.parameters(),
                        need_update=(data_iter_step + 1) % args.accum_iter == 0)
            if (data_iter_step + 1) % args.accum_iter == 0:
                optimizer.zero_grad()
            if rank == 0 and data_iter_step % 200 == 0:
                print(f"Epoch: [{epoch}] [{data_iter_step}/{len(data_loader_train)}] loss: {loss_value:.4f}")

        test_stats = evaluate(data_loader_val, model_without_ddp, device)
        max_accuracy = max(max_accuracy, test_stats["acc1"])
        if rank == 0:
            print(f"Accuracy of the network on the {len(dataset_val)} test images: {test_stats['acc1']:.1f}%")
            if epoch % 10 == 0 or epoch + 1 == args.epochs:
                torch.save({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch, "scaler": loss_scaler.state_dict(), "args": vars(args)},
                           out / f"checkpoint-{epoch}.pth")
            with open(out / "log.txt", "a") as f:
                f.write(json.dumps({"epoch": epoch, **test_stats, "max_acc1": max_accuracy}) + "\n")

    if rank == 0:
        print(f"Training time {time.time() - start_time:.0f}s, max accuracy {max_accuracy:.2f}%")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args())
