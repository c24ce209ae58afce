"""
Train a YOLOv5s-style detector on a custom dataset (YOLO txt labels, background images allowed).

Usage:
    $ python -m torch.distributed.run --nproc_per_node 4 05_yolov5s_coco.py --data data/custom.yaml --img 640 --batch 64
"""
import argparse
import math
import os
import random
import time
from copy import deepcopy
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.cuda import amp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import lr_scheduler

from models.yolo import Model
from utils.dataloaders import create_dataloader
from utils.general import check_dataset, init_seeds, one_cycle, colorstr
from utils.loss import ComputeLoss
from utils.torch_utils import ModelEMA, de_parallel, smart_optimizer, torch_distributed_zero_first
import val as validate

LOCAL_RANK = int(os.getenv("LOCAL_RANK", -1))
RANK = int(os.getenv("RANK", -1))
WORLD_SIZE = int(os.getenv("WORLD_SIZE", 1))


def train(hyp, opt, device):
    save_dir = Path(opt.save_dir)
    w = save_dir / "weights"
    if RANK in {-1, 0}:
        w.mkdir(parents=True, exist_ok=True)
        with open(save_dir / "hyp.yaml", "w") as f:
            yaml.safe_dump(hyp, f, sort_keys=False)
    last, best = w / "last.pt", w / "best.pt"

    init_seeds(opt.seed + 1 + RANK, deterministic=True)
    with torch_distributed_zero_first(LOCAL_RANK):
        data_dict = check_dataset(opt.data)  # may download on rank 0
    train_path, val_path = data_dict["train"], data_dict["val"]
    nc = int(data_dict["nc"])
    names = data_dict["names"]

    model = Model(opt.cfg, ch=3, nc=nc, anchors=hyp.get("anchors")).to(device)
    gs = max(int(model.stride.max()), 32)
    imgsz = opt.imgsz

    nbs = 64  # nominal batch size
    accumulate = max(round(nbs / opt.batch_size), 1)
    hyp["weight_decay"] *= opt.batch_size * accumulate / nbs
    optimizer = smart_optimizer(model, opt.optimizer, hyp["lr0"], hyp["momentum"], hyp["weight_decay"])

    lf = one_cycle(1, hyp["lrf"], opt.epochs)
    scheduler = lr_scheduler.LambdaLR(optimizer, lr_lambda=lf)
    ema = ModelEMA(model) if RANK in {-1, 0} else None

    if RANK != -1 and opt.sync_bn:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)

    # opt.batch_size is the total batch, split across GPUs
    train_loader, dataset = create_dataloader(train_path, imgsz, opt.batch_size // WORLD_SIZE, gs,
                                              hyp=hyp, augment=True, rect=False, rank=LOCAL_RANK,
                                              workers=opt.workers, prefix=colorstr("train: "), shuffle=True)
    nb = len(train_loader)
    if RANK in {-1, 0}:
        val_loader = create_dataloader(val_path, imgsz, opt.batch_size // WORLD_SIZE * 2, gs, hyp=hyp,
                                       rect=True, rank=-1, workers=opt.workers * 2, pad=0.5,
                                       prefix=colorstr("val: "))[0]

    if RANK != -1:
        model = DDP(model, device_ids=[LOCAL_RANK], output_device=LOCAL_RANK)

    nl = de_parallel(model).model[-1].nl
    hyp["box"] *= 3 / nl
    hyp["cls"] *= nc / 80 * 3 / nl
    hyp["obj"] *= (imgsz / 640) ** 2 * 3 / nl
    de_parallel(model).nc = nc
    de_parallel(model).hyp = hyp
    de_parallel(model).names = names

    nw = max(round(hyp["warmup_epochs"] * nb), 100)
    last_opt_step = -1
    best_fitness = 0.0
    scheduler.last_epoch = -1
    scaler = amp.GradScaler(enabled=True)
    compute_loss = ComputeLoss(model)  # uses de_parallel internally
    t0 = time.time()
    for epoch in range(opt.epochs):
        model.train()
        if RANK != -1:
            train_loader.sampler.set_epoch(epoch)
        mloss = torch.zeros(3, device=device)
        pbar = enumerate(train_loader)
        optimizer.zero_grad()
        for i, (imgs, targets, paths, _) in pbar:
            ni = i + nb * epoch
            if targets.shape[0] == 0:
                continue  # background-only batch, nothing to regress
            imgs = imgs.to(device, non_blocking=True).float() / 255

            # warmup
            if ni <= nw:
                xi = [0, nw]
                accumulate = max(1, np.interp(ni, xi, [1, nbs / opt.batch_size]).round())
                for j, x in enumerate(optimizer.param_groups):
                    x["lr"] = np.interp(ni, xi, [hyp["warmup_bias_lr"] if j == 0 else 0.0, x["initial_lr"] * lf(epoch)])
                    if "momentum" in x:
                        x["momentum"] = np.interp(ni, xi, [hyp["warmup_momentum"], hyp["momentum"]])

            with amp.autocast():
                pred = model(imgs)
                loss, loss_items = compute_loss(pred, targets.to(device))
                if RANK != -1:
                    loss *= WORLD_SIZE  # gradient averaged between devices in DDP mode

            scaler.scale(loss).backward()

            if ni - last_opt_step >= accumulate:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                if ema:
                    ema.update(model)
                last_opt_step = ni

            if RANK in {-1, 0}:
                mloss = (mloss * i + loss_items) / (i + 1)
                if i % 50 == 0:
                    mem = f"{torch.cuda.memory_reserved() / 1e9:.3g}G"
                    print(f"{epoch}/{opt.epochs - 1} {mem} box {mloss[0]:.4f} obj {mloss[1]:.4f} "
                          f"cls {mloss[2]:.4f} {targets.shape[0]} {imgs.shape[-1]}")

        lr = [x["lr"] for x in optimizer.param_groups]
        scheduler.step()

        if RANK in {-1, 0}:
            ema.update_attr(model, include=["yaml", "nc", "hyp", "names", "stride", "class_weights"])
            final_epoch = epoch + 1 == opt.epochs
            results, maps, _ = validate.run(data_dict, batch_size=opt.batch_size // WORLD_SIZE * 2,
                                            imgsz=imgsz, half=True, model=ema.ema, dataloader=val_loader,
                                            save_dir=save_dir, plots=final_epoch, compute_loss=compute_loss)
            # fitness = 0.1 * mAP@.5 + 0.9 * mAP@.5:.95
            fi = 0.1 * results[2] + 0.9 * results[3]
            if fi > best_fitness:
                best_fitness = fi
            ckpt = {
                "epoch": epoch,
                "best_fitness": best_fitness,
                "model": deepcopy(de_parallel(model)).half(),
                "ema": deepcopy(ema.ema).half(),
                "updates": ema.updates,
                "optimizer": optimizer.state_dict(),
                "opt": vars(opt),
            }
            torch.save(ckpt, last)
            if best_fitness == fi:
                torch.save(ckpt, best)
            del ckpt
            print(f"epoch {epoch}: P {results[0]:.3f} R {results[1]:.3f} mAP50 {results[2]:.3f} "
                  f"mAP50-95 {results[3]:.3f} lr {lr[0]:.5f}")

    if RANK in {-1, 0}:
        print(f"\n{opt.epochs} epochs completed in {(time.time() - t0) / 3600:.3f} hours.")
    torch.cuda.empty_cache()


def parse_opt():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", type=str, default="models/yolov5s.yaml")
    parser.add_argument("--data", type=str, default="data/custom.yaml")
    parser.add_argument("--hyp", type=str, default="data/hyps/hyp.scratch-low.yaml")
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--batch-size", "--batch", type=int, default=64, help="total batch size for all GPUs")
    parser.add_argument("--imgsz", "--img", type=int, default=640)
    parser.add_argument("--optimizer", type=str, choices=["SGD", "Adam", "AdamW"], default="SGD")
    parser.add_argument("--sync-bn", action="store_true")
    parser.add_argument("--workers", type=int, default=8, help="max dataloader workers (per RANK in DDP mode)")
    parser.add_argument("--save-dir", type=str, default="runs/train/exp")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main(opt):
    with open(opt.hyp, errors="ignore") as f:
        hyp = yaml.safe_load(f)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if LOCAL_RANK != -1:
        assert opt.batch_size % WORLD_SIZE == 0, f"--batch-size {opt.batch_size} must be multiple of WORLD_SIZE"
        assert torch.cuda.device_count() > LOCAL_RANK, "insufficient CUDA devices for DDP command"
        torch.cuda.set_device(LOCAL_RANK)
        device = torch.device("cuda", LOCAL_RANK)
        dist.init_process_group(backend="nccl" if dist.is_nccl_available() else "gloo",
                                timeout=timedelta(seconds=10800))
    train(hyp, opt, device)
    if WORLD_SIZE > 1 and RANK == 0:
        print("Destroying process group... ")
    if WORLD_SIZE > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_opt())
