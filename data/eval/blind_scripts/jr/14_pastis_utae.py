"""
Panoptic-free semantic segmentation of crop types on PASTIS with U-TAE
(satellite image time series, Sentinel-2, up to 61 dates per patch).

Uses the model and dataset code from the utae-paps repository (src/ on PYTHONPATH).

    torchrun --nproc_per_node=4 14_pastis_utae.py --dataset_folder /shared/PASTIS --res_dir /shared/runs/utae_f1 --fold 1
"""
import argparse
import json
import os
import pprint
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from src import utils
from src.backbones.utae import UTAE
from src.dataset import PASTIS_Dataset

FOLDS = [
    [[1, 2, 3], [4], [5]],
    [[2, 3, 4], [5], [1]],
    [[3, 4, 5], [1], [2]],
    [[4, 5, 1], [2], [3]],
    [[5, 1, 2], [3], [4]],
]
NUM_CLASSES = 20
VOID_CLASS = 19  # zero weight in the loss, dropped from the metrics


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset_folder", required=True)
    p.add_argument("--res_dir", required=True)
    p.add_argument("--fold", type=int, default=1)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--num_workers", type=int, default=8)
    p.add_argument("--mono_date", default=None)
    p.add_argument("--ignore_void", action="store_true", default=True)
    return p.parse_args()


def iou_from_confusion(cm, ignore=VOID_CLASS):
    cm = cm.clone().double()
    keep = [i for i in range(cm.shape[0]) if i != ignore]
    cm = cm[keep][:, keep]
    iou = cm.diag() / (cm.sum(0) + cm.sum(1) - cm.diag()).clamp(min=1)
    oa = cm.diag().sum() / cm.sum().clamp(min=1)
    return iou.mean().item(), oa.item()


def run_epoch(model, loader, criterion, device, optimizer=None):
    training = optimizer is not None
    model.train(training)
    cm = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long, device=device)
    loss_sum = torch.zeros(2, device=device)
    with torch.set_grad_enabled(training):
        for (x, dates), y in loader:
            x = x.to(device, non_blocking=True).float()
            dates = dates.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True).long()
            out = model(x, batch_positions=dates)
            loss = criterion(out, y)
            if training:
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            pred = out.argmax(1)
            cm += torch.bincount(y.flatten() * NUM_CLASSES + pred.flatten(),
                                 minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES)
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
    dist.all_reduce(cm)
    dist.all_reduce(loss_sum)
    miou, oa = iou_from_confusion(cm)
    return (loss_sum[0] / loss_sum[1]).item(), miou, oa


def save_checkpoint(path, model, optimizer, epoch, best_miou):
    torch.save({"epoch": epoch, "state_dict": model.module.state_dict(),
                "optimizer": optimizer.state_dict(), "best_mIoU": best_miou}, path)


def main():
    cfg = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    fold_dir = os.path.join(cfg.res_dir, f"Fold_{cfg.fold}")
    os.makedirs(fold_dir, exist_ok=True)
    if rank == 0:
        with open(os.path.join(cfg.res_dir, "conf.json"), "w") as f:
            json.dump(vars(cfg), f, indent=4)
        pprint.pprint(vars(cfg))

    train_folds, val_folds, _ = FOLDS[cfg.fold - 1]
    dt_args = dict(folder=cfg.dataset_folder, norm=True, target="semantic", sats=["S2"], mono_date=cfg.mono_date)
    dt_train = PASTIS_Dataset(**dt_args, folds=train_folds, cache=False)
    dt_val = PASTIS_Dataset(**dt_args, folds=val_folds, cache=False)
    collate = lambda b: utils.pad_collate(b, pad_value=0)
    train_sampler = DistributedSampler(dt_train, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(dt_val, shuffle=False, drop_last=True)
    train_loader = DataLoader(dt_train, batch_size=cfg.batch_size, sampler=train_sampler, drop_last=True,
                              collate_fn=collate, num_workers=cfg.num_workers, pin_memory=True)
    val_loader = DataLoader(dt_val, batch_size=cfg.batch_size, sampler=val_sampler,
                            collate_fn=collate, num_workers=cfg.num_workers, pin_memory=True)

    model = UTAE(input_dim=10, encoder_widths=[64, 64, 64, 128], decoder_widths=[32, 32, 64, 128],
                 out_conv=[32, NUM_CLASSES], str_conv_k=4, str_conv_s=2, str_conv_p=1, agg_mode="att_group",
                 encoder_norm="group", n_head=16, d_model=256, d_k=4, encoder=False, return_maps=False,
                 pad_value=0, padding_mode="reflect")
    model = DDP(model.to(device), device_ids=[local_rank])
    weights = torch.ones(NUM_CLASSES, device=device)
    if cfg.ignore_void:
        weights[VOID_CLASS] = 0.0
    criterion = nn.CrossEntropyLoss(weight=weights)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)

    ckpt_path = os.path.join(fold_dir, "model.pth.tar")
    best_path = os.path.join(fold_dir, "model_best.pth.tar")
    start_epoch, best_miou = 1, 0.0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best_miou = ckpt["epoch"] + 1, ckpt["best_mIoU"]
        if rank == 0:
            print(f"resuming from epoch {ckpt['epoch']}")

    trainlog = {}
    for epoch in range(start_epoch, cfg.epochs + 1):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        tr_loss, tr_miou, tr_oa = run_epoch(model, train_loader, criterion, device, optimizer)
        va_loss, va_miou, va_oa = run_epoch(model, val_loader, criterion, device)
        trainlog[epoch] = {"train_loss": tr_loss, "train_mIoU": tr_miou, "train_OA": tr_oa,
                           "val_loss": va_loss, "val_mIoU": va_miou, "val_OA": va_oa}
        if rank == 0:
            print(f"[{epoch}/{cfg.epochs}] train loss {tr_loss:.4f} mIoU {tr_miou:.4f} | "
                  f"val loss {va_loss:.4f} mIoU {va_miou:.4f} OA {va_oa:.4f} | {time.time() - t0:.0f}s",
                  flush=True)
            with open(os.path.join(fold_dir, "trainlog.json"), "w") as f:
                json.dump(trainlog, f, indent=2)

        if va_miou > best_miou:
            best_miou = va_miou
            save_checkpoint(best_path, model, optimizer, epoch, best_miou)
        save_checkpoint(ckpt_path, model, optimizer, epoch, best_miou)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
