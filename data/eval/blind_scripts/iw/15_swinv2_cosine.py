"""SwinV2-B (window 12->24) fine-tuning on ImageNet-1k at 384px from an ImageNet-22k checkpoint.

    torchrun --nproc_per_node=8 15_swinv2_cosine.py --pretrained swinv2_base_w12_192_22k.pth
"""
import argparse
import json
import logging
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision import datasets

import timm
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.scheduler import CosineLRScheduler
from timm.utils import AverageMeter, ModelEmaV2, accuracy

log = logging.getLogger("swinv2")


def parse_option():
    parser = argparse.ArgumentParser("SwinV2 fine-tuning")
    parser.add_argument("--data-path", default="/mnt/imagenet")
    parser.add_argument("--model", default="swinv2_base_window12to24_192to384")
    parser.add_argument("--pretrained", default="")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--warmup-epochs", type=int, default=5)
    parser.add_argument("--base-lr", type=float, default=2e-5, help="per 512 images")
    parser.add_argument("--layer-decay", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=1e-8)
    parser.add_argument("--drop-path", type=float, default=0.2)
    parser.add_argument("--ema-decay", type=float, default=0.99985)
    parser.add_argument("--eval-freq", type=int, default=1)
    parser.add_argument("--output", default="output/swinv2_b_384")
    parser.add_argument("--workers", type=int, default=8)
    return parser.parse_args()


def reduce_tensor(tensor):
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    rt /= dist.get_world_size()
    return rt


def layer_scale(name, depths, decay):
    num_layers = sum(depths) + 1
    if name.startswith(("patch_embed", "absolute_pos_embed")):
        lid = 0
    elif name.startswith("layers."):
        stage = int(name.split(".")[1])
        if ".blocks." in name:
            block = int(name.split(".")[3])
            lid = sum(depths[:stage]) + block + 1
        else:
            lid = sum(depths[:stage + 1])
    else:
        lid = num_layers
    return decay ** (num_layers - lid)


def build_optimizer(model, args, base_lr):
    depths = [len(layer.blocks) for layer in model.layers]
    skip_kw = ("cpb_mlp", "logit_scale", "relative_position_bias_table")
    groups = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        wd = 0.0 if (p.ndim == 1 or n.endswith(".bias") or any(k in n for k in skip_kw)) else args.weight_decay
        scale = layer_scale(n, depths, args.layer_decay)
        key = (scale, wd)
        groups.setdefault(key, {"params": [], "weight_decay": wd, "lr": base_lr * scale})["params"].append(p)
    return torch.optim.AdamW(list(groups.values()), lr=base_lr, betas=(0.9, 0.999), eps=1e-8)


@torch.no_grad()
def validate(data_loader, model):
    criterion = torch.nn.CrossEntropyLoss()
    model.eval()
    loss_meter, acc1_meter, acc5_meter = AverageMeter(), AverageMeter(), AverageMeter()
    for images, target in data_loader:
        images = images.cuda(non_blocking=True)
        target = target.cuda(non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(images)
        loss = criterion(output.float(), target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        acc1 = reduce_tensor(acc1)
        acc5 = reduce_tensor(acc5)
        loss = reduce_tensor(loss)
        loss_meter.update(loss.item(), target.size(0))
        acc1_meter.update(acc1.item(), target.size(0))
        acc5_meter.update(acc5.item(), target.size(0))
    return acc1_meter.avg, acc5_meter.avg, loss_meter.avg


def main():
    args = parse_option()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format=f"[%(asctime)s r{rank}] %(message)s")
    torch.manual_seed(0 + rank)
    os.makedirs(args.output, exist_ok=True)

    train_tf = create_transform(384, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic")
    val_tf = create_transform(384, is_training=False, crop_pct=1.0, interpolation="bicubic")
    dataset_train = datasets.ImageFolder(os.path.join(args.data_path, "train"), train_tf)
    dataset_val = datasets.ImageFolder(os.path.join(args.data_path, "val"), val_tf)
    sampler_train = torch.utils.data.DistributedSampler(dataset_train, shuffle=True)
    data_loader_train = torch.utils.data.DataLoader(dataset_train, sampler=sampler_train,
                                                    batch_size=args.batch_size, num_workers=args.workers,
                                                    pin_memory=True, drop_last=True)
    # 50k images at 384px: one GPU evaluates the full set, the others go on to the next epoch
    data_loader_val = torch.utils.data.DataLoader(dataset_val, batch_size=64, shuffle=False,
                                                  num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, num_classes=1000, drop_path_rate=args.drop_path)
    if args.pretrained:
        sd = torch.load(args.pretrained, map_location="cpu")
        sd = sd.get("model", sd)
        sd = {k: v for k, v in sd.items()
              if not k.startswith("head.") and "relative_position_index" not in k
              and "relative_coords_table" not in k and "attn_mask" not in k}
        log.info(model.load_state_dict(sd, strict=False))
    model.cuda()
    model = DDP(model, device_ids=[local_rank], broadcast_buffers=False)
    model_without_ddp = model.module
    model_ema = ModelEmaV2(model_without_ddp, decay=args.ema_decay)

    lr = args.base_lr * args.batch_size * world_size / 512
    optimizer = build_optimizer(model_without_ddp, args, lr)
    n_steps = len(data_loader_train)
    lr_scheduler = CosineLRScheduler(optimizer, t_initial=(args.epochs - args.warmup_epochs) * n_steps,
                                     lr_min=lr * 0.01, warmup_t=args.warmup_epochs * n_steps,
                                     warmup_lr_init=lr * 0.001, warmup_prefix=True, t_in_epochs=False)
    scaler = torch.cuda.amp.GradScaler()
    mixup_fn = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    criterion = SoftTargetCrossEntropy()

    max_accuracy = 0.0
    for epoch in range(args.epochs):
        sampler_train.set_epoch(epoch)
        model.train()
        loss_meter = AverageMeter()
        start = time.time()
        for idx, (samples, targets) in enumerate(data_loader_train):
            samples = samples.cuda(non_blocking=True)
            targets = targets.cuda(non_blocking=True)
            samples, targets = mixup_fn(samples, targets)
            with torch.cuda.amp.autocast():
                loss = criterion(model(samples), targets)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            lr_scheduler.step_update(epoch * n_steps + idx)
            model_ema.update(model_without_ddp)
            loss_meter.update(loss.item(), targets.size(0))
            if idx % 100 == 0:
                log.info(f"Train: [{epoch}/{args.epochs}][{idx}/{n_steps}] loss {loss_meter.avg:.4f}")
        log.info(f"EPOCH {epoch} training takes {time.time() - start:.0f}s")

        if (epoch + 1) % args.eval_freq == 0 or epoch == args.epochs - 1:
            if rank == 0:
                acc1, acc5, vloss = validate(data_loader_val, model_without_ddp)
                ema_acc1, _, _ = validate(data_loader_val, model_ema.module)
                max_accuracy = max(max_accuracy, acc1, ema_acc1)
                log.info(f"Acc@1 {acc1:.3f} Acc@5 {acc5:.3f} EMA Acc@1 {ema_acc1:.3f} max {max_accuracy:.2f}")
                torch.save({"model": model_without_ddp.state_dict(), "model_ema": model_ema.module.state_dict(),
                            "optimizer": optimizer.state_dict(), "lr_scheduler": lr_scheduler.state_dict(),
                            "scaler": scaler.state_dict(), "epoch": epoch, "max_accuracy": max_accuracy},
                           os.path.join(args.output, f"ckpt_epoch_{epoch}.pth"))
                with open(os.path.join(args.output, "log.jsonl"), "a") as f:
                    f.write(json.dumps({"epoch": epoch, "acc1": acc1, "acc5": acc5, "ema_acc1": ema_acc1}) + "\n")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
