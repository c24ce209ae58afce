"""Fine-tune a timm ViT on an ImageFolder dataset, launched from this script.

    python 06_spawn_vit_finetune.py --data /data/flowers --model vit_base_patch16_224.augreg_in21k \
        --gpus 8 --epochs 30

Workers are started with torch.multiprocessing (spawn). If the group dies the
launcher waits a bit and starts it again; the workers resume from
<output>/checkpoint.pth. stdout/stderr of worker k go to <output>/logs/worker<k>.txt.
"""
import argparse
import datetime
import os
import random
import socket
import sys
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from timm.data import create_transform, resolve_data_config
from timm.loss import SoftTargetCrossEntropy
from timm.data.mixup import Mixup
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder


def parse_args():
    parser = argparse.ArgumentParser("vit finetune")
    parser.add_argument("--data", required=True)
    parser.add_argument("--model", default="vit_base_patch16_224.augreg_in21k")
    parser.add_argument("--output", default="output/vit_ft")
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--attempts", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64, help="per GPU")
    parser.add_argument("--blr", type=float, default=5e-4, help="lr for a global batch of 256")
    parser.add_argument("--layer-decay", type=float, default=0.65)
    parser.add_argument("--warmup-epochs", type=int, default=3)
    parser.add_argument("--mixup", type=float, default=0.8)
    parser.add_argument("--cutmix", type=float, default=1.0)
    parser.add_argument("--smoothing", type=float, default=0.1)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def redirect_output(path):
    """Point this process's stdout/stderr (fd 1 and 2) at a log file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def cosine_lr(step, total, warmup, base):
    if step < warmup:
        return base * step / max(1, warmup)
    return 0.5 * base * (1 + np.cos(np.pi * (step - warmup) / max(1, total - warmup)))


def param_groups_lrd(model, weight_decay, layer_decay):
    num_layers = len(model.blocks) + 1
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = p.ndim == 1 or name in ("pos_embed", "cls_token")
        if name.startswith(("cls_token", "pos_embed", "patch_embed")):
            layer_id = 0
        elif name.startswith("blocks."):
            layer_id = int(name.split(".")[1]) + 1
        else:
            layer_id = num_layers
        key = f"layer{layer_id}_{'nd' if no_decay else 'd'}"
        if key not in groups:
            scale = layer_decay ** (num_layers - layer_id)
            groups[key] = {"params": [], "weight_decay": 0.0 if no_decay else weight_decay, "lr_scale": scale}
        groups[key]["params"].append(p)
    return list(groups.values())


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    top1 = torch.zeros(2, device=device)
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(images)
        top1[0] += (out.argmax(-1) == target).sum()
        top1[1] += target.numel()
    dist.all_reduce(top1)
    return (top1[0] / top1[1]).item()


def train_worker(local_rank, args, world_size, port):
    redirect_output(os.path.join(args.output, "logs", f"worker{local_rank}.txt"))
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=local_rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=30))
    device = torch.device(f"cuda:{local_rank}")
    rank = local_rank
    seed = args.seed + rank
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

    model = timm.create_model(args.model, pretrained=True, drop_path_rate=0.1)
    data_cfg = resolve_data_config({}, model=model)
    train_tf = create_transform(**data_cfg, is_training=True, auto_augment="rand-m9-mstd0.5-inc1")
    eval_tf = create_transform(**data_cfg, is_training=False)
    train_set = ImageFolder(os.path.join(args.data, "train"), transform=train_tf)
    val_set = ImageFolder(os.path.join(args.data, "val"), transform=eval_tf)
    model.reset_classifier(len(train_set.classes))
    model.to(device)

    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world_size)),
                            batch_size=128, num_workers=args.num_workers, pin_memory=True)

    mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                     num_classes=len(train_set.classes))
    criterion = SoftTargetCrossEntropy()
    lr = args.blr * args.batch_size * world_size / 256
    optimizer = torch.optim.AdamW(param_groups_lrd(model, 0.05, args.layer_decay), lr=lr)

    start_epoch, best = 0, 0.0
    ckpt_path = os.path.join(args.output, "checkpoint.pth")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        print(f"resumed from epoch {ckpt['epoch']}", flush=True)
    model_ddp = DDP(model, device_ids=[local_rank])

    steps_per_epoch = len(train_loader)
    total_steps = args.epochs * steps_per_epoch
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model_ddp.train()
        t0 = time.time()
        for i, (images, target) in enumerate(train_loader):
            step = epoch * steps_per_epoch + i
            cur_lr = cosine_lr(step, total_steps, args.warmup_epochs * steps_per_epoch, lr)
            for g in optimizer.param_groups:
                g["lr"] = cur_lr * g["lr_scale"]
            images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
            images, target = mixup_fn(images, target)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model_ddp(images), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model_ddp.parameters(), 1.0)
            optimizer.step()
            if i % 50 == 0:
                print(f"epoch {epoch} [{i}/{steps_per_epoch}] loss {loss.item():.4f} lr {cur_lr:.2e}", flush=True)

        acc = evaluate(model, val_loader, device)
        print(f"epoch {epoch} val top1 {acc:.4f} time {time.time() - t0:.0f}s", flush=True)
        if rank == 0:
            best = max(best, acc)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch, "best": best, "args": vars(args)}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


def free_port():
    s = socket.socket()
    s.bind(("", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def main(args):
    os.makedirs(args.output, exist_ok=True)
    # fetch the pretrained weights once, so the workers only read the hub cache
    timm.create_model(args.model, pretrained=True)
    for attempt in range(1, args.attempts + 1):
        port = free_port()
        print(f"[launch] attempt {attempt}/{args.attempts} with {args.gpus} GPUs (port {port})", flush=True)
        try:
            mp.spawn(train_worker, args=(args, args.gpus, port), nprocs=args.gpus, join=True)
            return 0
        except Exception as e:  # ProcessRaisedException / ProcessExitedException
            print(f"[launch] attempt {attempt} failed: {e!r}", flush=True)
            time.sleep(30)
    return 1


args = parse_args()
sys.exit(main(args))
