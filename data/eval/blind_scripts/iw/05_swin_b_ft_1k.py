"""Swin-B: ImageNet-22k pre-trained -> ImageNet-1k fine-tuning (Swin repo style).

Usage (one node, 8 GPUs):
    torchrun --nproc_per_node 8 05_swin_b_ft_1k.py --cfg configs/swin_b_22kto1k.yaml
"""
import argparse
import datetime
import logging
import os
import time

import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel
from torchvision import datasets

import timm
from timm.data import Mixup, create_transform
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.scheduler import CosineLRScheduler
from timm.utils import AverageMeter, accuracy

DEFAULTS = {
    "DATA": {"PATH": "/data/imagenet", "IMG_SIZE": 224, "BATCH_SIZE": 64, "WORKERS": 8},
    "MODEL": {"NAME": "swin_base_patch4_window7_224", "NUM_CLASSES": 1000, "DROP_PATH": 0.2,
              "PRETRAINED": "/ckpt/swin_base_patch4_window7_224_22k.pth", "RESUME": ""},
    "TRAIN": {"EPOCHS": 30, "WARMUP_EPOCHS": 5, "BASE_LR": 2e-5, "MIN_LR": 2e-7,
              "WARMUP_LR": 2e-8, "WEIGHT_DECAY": 1e-8, "CLIP_GRAD": 5.0, "LABEL_SMOOTHING": 0.1},
    "AUG": {"MIXUP": 0.8, "CUTMIX": 1.0, "MIXUP_PROB": 1.0, "MIXUP_SWITCH_PROB": 0.5},
    "OUTPUT": "output/swin_b_22kto1k",
    "SAVE_FREQ": 1,
    "PRINT_FREQ": 100,
}


def load_config(path, overrides):
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in DEFAULTS.items()}
    if path:
        with open(path) as f:
            user = yaml.safe_load(f) or {}
        for k, v in user.items():
            if isinstance(v, dict):
                cfg[k].update(v)
            else:
                cfg[k] = v
    for item in overrides or []:
        key, val = item.split("=", 1)
        sec, name = key.split(".")
        cfg[sec][name] = type(cfg[sec][name])(val) if cfg[sec].get(name) is not None else val
    return cfg


def create_logger(out_dir, rank):
    logger = logging.getLogger("swin")
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    fmt = logging.Formatter(f"[%(asctime)s rank{rank}] %(message)s", "%H:%M:%S")
    sh = logging.StreamHandler()
    sh.setFormatter(fmt)
    logger.addHandler(sh)
    if rank == 0:
        fh = logging.FileHandler(os.path.join(out_dir, "log_rank0.txt"))
        fh.setFormatter(fmt)
        logger.addHandler(fh)
    return logger


def load_pretrained(cfg, model, logger):
    ckpt = torch.load(cfg["MODEL"]["PRETRAINED"], map_location="cpu")
    state = ckpt["model"] if "model" in ckpt else ckpt
    # relative_position_index / attn_mask are rebuilt by the model
    for k in [k for k in state if "relative_position_index" in k or "attn_mask" in k]:
        del state[k]
    if state["head.fc.weight"].shape[0] != cfg["MODEL"]["NUM_CLASSES"]:
        logger.info("22k head does not match, re-initialising classifier")
        del state["head.fc.weight"], state["head.fc.bias"]
    msg = model.load_state_dict(state, strict=False)
    logger.info(f"loaded {cfg['MODEL']['PRETRAINED']}: {msg}")


def resume(cfg, model, optimizer, scheduler, scaler, logger):
    logger.info(f"resuming from {cfg['MODEL']['RESUME']}")
    ckpt = torch.load(cfg["MODEL"]["RESUME"])
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["lr_scheduler"])
    scaler.load_state_dict(ckpt["scaler"])
    start_epoch, max_acc = ckpt["epoch"] + 1, ckpt.get("max_accuracy", 0.0)
    del ckpt
    torch.cuda.empty_cache()
    return start_epoch, max_acc


def train_one_epoch(cfg, model, criterion, loader, optimizer, epoch, mixup_fn, scheduler, scaler, logger):
    model.train()
    optimizer.zero_grad()
    num_steps = len(loader)
    loss_meter = AverageMeter()
    start = time.time()
    for idx, (samples, targets) in enumerate(loader):
        samples = samples.cuda(non_blocking=True)
        targets = targets.cuda(non_blocking=True)
        samples, targets = mixup_fn(samples, targets)
        with torch.cuda.amp.autocast():
            outputs = model(samples)
        loss = criterion(outputs.float(), targets)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["TRAIN"]["CLIP_GRAD"])
        scaler.step(optimizer)
        scaler.update()
        scheduler.step_update(epoch * num_steps + idx)
        loss_meter.update(loss.item(), targets.size(0))
        if idx % cfg["PRINT_FREQ"] == 0:
            lr = optimizer.param_groups[0]["lr"]
            mem = torch.cuda.max_memory_allocated() / 2 ** 20
            logger.info(f"Train [{epoch}][{idx}/{num_steps}] lr {lr:.6f} loss {loss_meter.val:.4f} "
                        f"({loss_meter.avg:.4f}) grad_norm {grad_norm:.3f} mem {mem:.0f}MB")
    logger.info(f"epoch {epoch} took {datetime.timedelta(seconds=int(time.time() - start))}")


@torch.no_grad()
def validate(model, loader, logger):
    model.eval()
    criterion = torch.nn.CrossEntropyLoss(reduction="sum")
    sums = torch.zeros(4, dtype=torch.float64, device="cuda")  # loss, top1, top5, n
    for images, target in loader:
        images = images.cuda(non_blocking=True)
        target = target.cuda(non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(images)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        n = target.size(0)
        sums += torch.stack([criterion(output.float(), target).double(),
                             acc1.double() * n / 100, acc5.double() * n / 100,
                             torch.tensor(n, dtype=torch.float64, device=sums.device)])
    dist.all_reduce(sums)
    acc1, acc5, loss = (100 * sums[1] / sums[3]).item(), (100 * sums[2] / sums[3]).item(), (sums[0] / sums[3]).item()
    logger.info(f" * Acc@1 {acc1:.3f} Acc@5 {acc5:.3f} loss {loss:.4f}")
    return acc1, acc5, loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", default="")
    parser.add_argument("--opts", nargs="*", default=[])
    args = parser.parse_args()
    cfg = load_config(args.cfg, args.opts)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)
    torch.backends.cudnn.benchmark = True

    os.makedirs(cfg["OUTPUT"], exist_ok=True)
    logger = create_logger(cfg["OUTPUT"], rank)

    size = cfg["DATA"]["IMG_SIZE"]
    train_tf = create_transform(size, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, re_mode="pixel", interpolation="bicubic")
    val_tf = create_transform(size, is_training=False, crop_pct=0.875, interpolation="bicubic")
    ds_train = datasets.ImageFolder(os.path.join(cfg["DATA"]["PATH"], "train"), train_tf)
    ds_val = datasets.ImageFolder(os.path.join(cfg["DATA"]["PATH"], "val"), val_tf)
    sampler_train = torch.utils.data.DistributedSampler(ds_train, shuffle=True)
    # strided shard of val without padding, so the reduced top-1 counts every image once
    ds_val = torch.utils.data.Subset(ds_val, range(rank, len(ds_val), world_size))
    loader_train = torch.utils.data.DataLoader(ds_train, sampler=sampler_train,
                                               batch_size=cfg["DATA"]["BATCH_SIZE"],
                                               num_workers=cfg["DATA"]["WORKERS"],
                                               pin_memory=True, drop_last=True)
    loader_val = torch.utils.data.DataLoader(ds_val, shuffle=False,
                                             batch_size=cfg["DATA"]["BATCH_SIZE"],
                                             num_workers=cfg["DATA"]["WORKERS"],
                                             pin_memory=True, drop_last=False)

    model = timm.create_model(cfg["MODEL"]["NAME"], num_classes=cfg["MODEL"]["NUM_CLASSES"],
                              drop_path_rate=cfg["MODEL"]["DROP_PATH"])
    if cfg["MODEL"]["PRETRAINED"] and not cfg["MODEL"]["RESUME"]:
        load_pretrained(cfg, model, logger)
    model.cuda()
    model = DistributedDataParallel(model, device_ids=[local_rank], broadcast_buffers=False)
    model_without_ddp = model.module

    total_bs = cfg["DATA"]["BATCH_SIZE"] * world_size
    scale = total_bs / 512.0
    base_lr, warmup_lr, min_lr = (cfg["TRAIN"]["BASE_LR"] * scale, cfg["TRAIN"]["WARMUP_LR"] * scale,
                                  cfg["TRAIN"]["MIN_LR"] * scale)
    skip = model_without_ddp.no_weight_decay()
    decay = [p for n, p in model_without_ddp.named_parameters() if p.ndim > 1 and n not in skip]
    no_decay = [p for n, p in model_without_ddp.named_parameters() if p.ndim <= 1 or n in skip]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=base_lr, weight_decay=cfg["TRAIN"]["WEIGHT_DECAY"],
                                  betas=(0.9, 0.999), eps=1e-8)
    n_steps = len(loader_train)
    scheduler = CosineLRScheduler(optimizer, t_initial=(cfg["TRAIN"]["EPOCHS"] - cfg["TRAIN"]["WARMUP_EPOCHS"]) * n_steps,
                                  lr_min=min_lr, warmup_lr_init=warmup_lr,
                                  warmup_t=cfg["TRAIN"]["WARMUP_EPOCHS"] * n_steps,
                                  cycle_limit=1, t_in_epochs=False, warmup_prefix=True)
    scaler = torch.cuda.amp.GradScaler()
    mixup_fn = Mixup(mixup_alpha=cfg["AUG"]["MIXUP"], cutmix_alpha=cfg["AUG"]["CUTMIX"],
                     prob=cfg["AUG"]["MIXUP_PROB"], switch_prob=cfg["AUG"]["MIXUP_SWITCH_PROB"],
                     label_smoothing=cfg["TRAIN"]["LABEL_SMOOTHING"],
                     num_classes=cfg["MODEL"]["NUM_CLASSES"])
    criterion = SoftTargetCrossEntropy()

    start_epoch, max_accuracy = 0, 0.0
    if cfg["MODEL"]["RESUME"]:
        start_epoch, max_accuracy = resume(cfg, model_without_ddp, optimizer, scheduler, scaler, logger)

    logger.info(f"start training: {world_size} GPUs, total batch {total_bs}, lr {base_lr:.2e}")
    for epoch in range(start_epoch, cfg["TRAIN"]["EPOCHS"]):
        sampler_train.set_epoch(epoch)
        train_one_epoch(cfg, model, criterion, loader_train, optimizer, epoch, mixup_fn,
                        scheduler, scaler, logger)
        acc1, acc5, _ = validate(model_without_ddp, loader_val, logger)
        max_accuracy = max(max_accuracy, acc1)
        logger.info(f"max accuracy {max_accuracy:.2f}%")
        if rank == 0 and (epoch % cfg["SAVE_FREQ"] == 0 or epoch == cfg["TRAIN"]["EPOCHS"] - 1):
            path = os.path.join(cfg["OUTPUT"], f"ckpt_epoch_{epoch}.pth")
            torch.save({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                        "lr_scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                        "max_accuracy": max_accuracy, "epoch": epoch}, path)
            logger.info(f"saved {path}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
