"""Semantic segmentation (DeepLabV3+ / ResNet-101) on aerial tiles, preemptible queue.

    #SBATCH --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=8
    #SBATCH --signal=USR1@180 --requeue --open-mode=append
    srun python train_seg.py --config configs/aerial_dlv3p.yaml
"""
import argparse
import os
import signal
import subprocess
import sys
import time

import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from aerial.datasets import TileDataset, train_transforms, val_transforms

_preempted = False


def _handle_usr1(signum, frame):
    global _preempted
    _preempted = True


def setup_slurm():
    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    if "MASTER_ADDR" not in os.environ:
        nodes = subprocess.check_output(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                                        text=True).split()
        os.environ["MASTER_ADDR"] = nodes[0]
    os.environ.setdefault("MASTER_PORT", "29511")
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world)
    return rank, world, local_rank


def confusion(pred, target, num_classes, ignore_index=255):
    keep = target != ignore_index
    idx = target[keep] * num_classes + pred[keep]
    return torch.bincount(idx, minlength=num_classes ** 2).reshape(num_classes, num_classes)


@torch.no_grad()
def validate(net, loader, num_classes, device):
    net.eval()
    cm = torch.zeros(num_classes, num_classes, dtype=torch.long, device=device)
    for img, mask in loader:
        img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = net(img)
        cm += confusion(logits.argmax(1), mask, num_classes)
    dist.all_reduce(cm)
    net.train()
    iou = cm.diag().float() / (cm.sum(0) + cm.sum(1) - cm.diag()).float().clamp(min=1)
    return iou.mean().item(), iou.cpu().numpy()


def save_checkpoint(path, model, optimizer, scheduler, scaler, epoch, it, best_miou):
    state = {
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": epoch,
        "iter": it,
        "best_miou": best_miou,
    }
    torch.save(state, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.config))

    rank, world, local_rank = setup_slurm()
    device = torch.device("cuda", local_rank)
    signal.signal(signal.SIGUSR1, _handle_usr1)
    torch.manual_seed(cfg["seed"])
    np.random.seed(cfg["seed"] + rank)

    train_ds = TileDataset(cfg["data_root"], "train", train_transforms(cfg["crop"]))
    val_ds = TileDataset(cfg["data_root"], "val", val_transforms())
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True, seed=cfg["seed"])
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=4,
                            num_workers=4, pin_memory=True)

    net = smp.DeepLabV3Plus(encoder_name="resnet101", encoder_weights="imagenet",
                            classes=cfg["num_classes"])
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    criterion = nn.CrossEntropyLoss(ignore_index=255)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9,
                                weight_decay=cfg["weight_decay"])
    total_iters = cfg["epochs"] * len(train_loader)
    scheduler = torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=total_iters, power=0.9)
    scaler = torch.cuda.amp.GradScaler()

    ckpt_dir = cfg["ckpt_dir"]
    ckpt_path = os.path.join(ckpt_dir, "last.pt")
    start_epoch, start_iter, best_miou = 0, 0, 0.0
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, start_iter, best_miou = ckpt["epoch"], ckpt["iter"], ckpt["best_miou"]

    writer = None
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(ckpt_dir, "tb"), purge_step=start_epoch * len(train_loader) + start_iter)

    flag = torch.zeros(1, device=device)
    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        skip = start_iter if epoch == start_epoch else 0
        t0 = time.time()
        for it, (img, mask) in enumerate(train_loader):
            if it < skip:
                continue
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(img), mask)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()

            global_it = epoch * len(train_loader) + it
            if rank == 0 and it % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), global_it)
                writer.add_scalar("train/lr", scheduler.get_last_lr()[0], global_it)

            flag.fill_(float(_preempted))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                save_checkpoint(ckpt_path, model, optimizer, scheduler, scaler, epoch, it + 1, best_miou)
                dist.barrier()
                if rank == 0:
                    print(f"preempted at epoch {epoch} iter {it}, requeueing", flush=True)
                    writer.close()
                    subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]])
                dist.destroy_process_group()
                sys.exit(0)

        miou, per_class = validate(model.module, val_loader, cfg["num_classes"], device)
        if rank == 0:
            writer.add_scalar("val/mIoU", miou, epoch)
            for c, v in enumerate(per_class):
                writer.add_scalar(f"val_iou/class_{c}", v, epoch)
            print(f"epoch {epoch} mIoU {miou:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if miou > best_miou:
                best_miou = miou
                torch.save(model.module.state_dict(), os.path.join(ckpt_dir, "best.pt"))
            save_checkpoint(ckpt_path, model, optimizer, scheduler, scaler, epoch + 1, 0, best_miou)
        dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
