"""ViT-H/14 ImageNet-21k -> 1k fine-tuning with FSDP2.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        10_vit_fsdp2_imagenet.py --data /datasets/imagenet --run-name vith14-ft-448
"""
import argparse
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import wandb
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.datasets import ImageFolder


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/datasets/imagenet")
    p.add_argument("--model", default="vit_huge_patch14_224.orig_in21k")
    p.add_argument("--img-size", type=int, default=448)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--layer-decay", type=float, default=0.85)
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--warmup-epochs", type=int, default=3)
    p.add_argument("--mixup", type=float, default=0.8)
    p.add_argument("--cutmix", type=float, default=1.0)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--ckpt-dir", default="/checkpoints/vit")
    p.add_argument("--run-name", default="vit-ft")
    p.add_argument("--wandb-project", default="vision-infra")
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


def param_groups_lrd(model, wd, layer_decay):
    """Layer-wise lr decay as in BEiT / MAE fine-tuning."""
    n_layers = len(model.blocks) + 1
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_wd = p.ndim == 1 or name in ("pos_embed", "cls_token")
        if name.startswith(("cls_token", "pos_embed", "patch_embed")):
            layer_id = 0
        elif name.startswith("blocks."):
            layer_id = int(name.split(".")[1]) + 1
        else:
            layer_id = n_layers
        key = f"layer{layer_id}_{'nowd' if no_wd else 'wd'}"
        if key not in groups:
            groups[key] = {"params": [], "weight_decay": 0.0 if no_wd else wd,
                           "lr_scale": layer_decay ** (n_layers - layer_id)}
        groups[key]["params"].append(p)
    return list(groups.values())


def adjust_lr(optimizer, epoch_float, args):
    if epoch_float < args.warmup_epochs:
        lr = args.lr * epoch_float / args.warmup_epochs
    else:
        t = (epoch_float - args.warmup_epochs) / (args.epochs - args.warmup_epochs)
        lr = 1e-6 + (args.lr - 1e-6) * 0.5 * (1 + math.cos(math.pi * t))
    for g in optimizer.param_groups:
        g["lr"] = lr * g["lr_scale"]
    return lr


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args), resume="allow")

    model = timm.create_model(args.model, pretrained=True, num_classes=1000, img_size=args.img_size,
                              drop_path_rate=0.3)
    data_cfg = timm.data.resolve_data_config({}, model=model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.blocks:
        fully_shard(blk, mp_policy=mp)
    fully_shard(model, mp_policy=mp)

    train_tf = create_transform(args.img_size, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic",
                                mean=data_cfg["mean"], std=data_cfg["std"])
    val_tf = create_transform(args.img_size, is_training=False, crop_pct=1.0, interpolation="bicubic",
                              mean=data_cfg["mean"], std=data_cfg["std"])
    train_ds = ImageFolder(os.path.join(args.data, "train"), transform=train_tf)
    val_ds = ImageFolder(os.path.join(args.data, "val"), transform=val_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=val_sampler, num_workers=args.workers, pin_memory=True)

    mixup = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                  num_classes=1000)
    criterion = SoftTargetCrossEntropy()
    optimizer = torch.optim.AdamW(param_groups_lrd(model, args.wd, args.layer_decay), lr=args.lr,
                                  betas=(0.9, 0.999))

    start_epoch = 0
    ckpt_root = os.path.join(args.ckpt_dir, args.run_name)
    done = sorted(d for d in os.listdir(ckpt_root)
                  if os.path.exists(os.path.join(ckpt_root, d, ".metadata")) and d.startswith("epoch_")) \
        if os.path.isdir(ckpt_root) else []
    if done:
        last = os.path.join(ckpt_root, done[-1])
        msd, osd = get_state_dict(model, optimizer)
        st = {"model": msd, "optim": osd, "epoch": 0}
        dcp.load(st, checkpoint_id=last)
        set_state_dict(model, optimizer, model_state_dict=st["model"], optim_state_dict=st["optim"])
        start_epoch = st["epoch"] + 1

    steps_per_epoch = len(train_loader)
    best_top1 = 0.0
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (images, target) in enumerate(train_loader):
            lr = adjust_lr(optimizer, epoch + i / steps_per_epoch, args)
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            images, soft_target = mixup(images, target)
            out = model(images)
            loss = criterion(out.float(), soft_target)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

            if i % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                wandb.log({"train/loss": l.item(), "train/lr": lr, "train/grad_norm": gn.item(),
                           "train/img_per_s": 50 * args.batch_size * world / (time.time() - t0)},
                          step=epoch * steps_per_epoch + i)
                if rank == 0:
                    print(f"ep {epoch} it {i}/{steps_per_epoch} loss {l.item():.4f} lr {lr:.2e}", flush=True)
                t0 = time.time()

        model.eval()
        stats = torch.zeros(4, device=device)
        with torch.no_grad():
            for images, target in val_loader:
                images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
                logits = model(images).float()
                stats[0] += F.cross_entropy(logits, target, reduction="sum")
                top5 = logits.topk(5, dim=-1).indices
                stats[1] += (top5[:, 0] == target).sum()
                stats[2] += target.numel()
                stats[3] += (top5 == target[:, None]).any(-1).sum()
        dist.all_reduce(stats)
        val_loss, top1, top5 = (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item(), (stats[3] / stats[2]).item()
        wandb.log({"val/loss": val_loss, "val/top1": top1, "val/top5": top5, "epoch": epoch},
                  step=(epoch + 1) * steps_per_epoch)
        if rank == 0:
            print(f"epoch {epoch}: val_loss {val_loss:.4f} top1 {top1 * 100:.2f} top5 {top5 * 100:.2f}", flush=True)

        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd, "epoch": epoch},
                 checkpoint_id=os.path.join(ckpt_root, f"epoch_{epoch:03d}"))
        if top1 > best_top1:
            best_top1 = top1
            dcp.save({"model": get_state_dict(model, optimizer)[0]}, checkpoint_id=os.path.join(ckpt_root, "best"))

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
