"""SSD300 (VGG16 backbone) on VOC07+12, evaluated on VOC07 test (11-point mAP).

torchrun --nproc_per_node=4 18_ssd300_voc.py --voc-root /data/VOCdevkit --batch-size 8 --epochs 120
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import ConcatDataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.detection import ssd300_vgg16
from torchvision.models import VGG16_Weights
from torch.utils.tensorboard import SummaryWriter

from voc import VOCDetection, SSDAugmentation, BaseTransform, voc_collate, VOC_CLASSES
from voc_eval import voc_eval_detections


def get_args():
    p = argparse.ArgumentParser("SSD300 VOC")
    p.add_argument("--voc-root", default="/data/VOCdevkit")
    p.add_argument("--batch-size", type=int, default=8, help="per GPU, 32 in total on 4 GPUs as in the paper")
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--milestones", type=int, nargs="+", default=[80, 100])
    p.add_argument("--warmup-epochs", type=int, default=1)
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--save-folder", default="weights/ssd300_voc")
    p.add_argument("--resume", default="")
    p.add_argument("--eval-every", type=int, default=10)
    return p.parse_args()


def build_model(num_classes):
    model = ssd300_vgg16(weights=None, weights_backbone=VGG16_Weights.IMAGENET1K_FEATURES,
                         num_classes=num_classes, trainable_backbone_layers=5)
    return model


@torch.no_grad()
def evaluate(model, loader, dataset, device, rank, world_size):
    model.eval()
    local = {}
    for images, targets in loader:
        images = [img.to(device) for img in images]
        outputs = model(images)
        for t, o in zip(targets, outputs):
            local[int(t["index"])] = {k: v.cpu().numpy() for k, v in o.items()}
    parts = [None] * world_size
    dist.all_gather_object(parts, local)
    model.train()
    if rank != 0:
        return None
    all_dets = {}
    for p in parts:
        all_dets.update(p)  # padded duplicates overwrite each other, same index -> same image
    aps = voc_eval_detections(dataset, all_dets, iou_thresh=0.5, use_07_metric=True)
    return float(np.mean(aps)), aps


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    writer = None
    if rank == 0:
        os.makedirs(args.save_folder, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.save_folder, "tb"))

    train_set = ConcatDataset([
        VOCDetection(args.voc_root, image_set=("2007", "trainval"), transform=SSDAugmentation(300)),
        VOCDetection(args.voc_root, image_set=("2012", "trainval"), transform=SSDAugmentation(300)),
    ])
    test_set = VOCDetection(args.voc_root, image_set=("2007", "test"), transform=BaseTransform(300))
    train_sampler = DistributedSampler(train_set, shuffle=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, collate_fn=voc_collate, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=16, sampler=test_sampler, num_workers=args.num_workers,
                             collate_fn=voc_collate, pin_memory=True)

    model = build_model(num_classes=len(VOC_CLASSES) + 1)
    start_epoch, best_map, state = 0, 0.0, None
    if args.resume:
        state = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(state["model"])
        start_epoch, best_map = state["epoch"] + 1, state.get("best_map", 0.0)

    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)
    model.to(device)
    model_without_ddp = model.module

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=args.milestones, gamma=0.1)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])

    warmup_iters = args.warmup_epochs * len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t_start = time.time()
        sum_loss = torch.zeros(3, device=device)
        for i, (images, targets) in enumerate(train_loader):
            it = epoch * len(train_loader) + i
            if it < warmup_iters:
                for g in optimizer.param_groups:
                    g["lr"] = args.lr * (it + 1) / warmup_iters
            images = [img.to(device, non_blocking=True) for img in images]
            targets = [{"boxes": t["boxes"].to(device), "labels": t["labels"].to(device)} for t in targets]

            losses = model(images, targets)
            loss = losses["bbox_regression"] + losses["classification"]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sum_loss += torch.stack([loss.detach(), losses["bbox_regression"].detach(),
                                     losses["classification"].detach()])

        scheduler.step()
        dist.all_reduce(sum_loss)
        sum_loss /= world_size * len(train_loader)
        if rank == 0:
            print(f"epoch {epoch} loss {sum_loss[0]:.4f} (loc {sum_loss[1]:.4f} conf {sum_loss[2]:.4f}) "
                  f"lr {optimizer.param_groups[0]['lr']:.5f} time {time.time() - t_start:.0f}s", flush=True)
            writer.add_scalar("train/loss", sum_loss[0].item(), epoch)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            res = evaluate(model_without_ddp, test_loader, test_set, device, rank, world_size)
            if rank == 0:
                mean_ap, aps = res
                print(f"epoch {epoch}: VOC07 mAP {mean_ap:.4f}")
                for cls, ap in zip(VOC_CLASSES, aps):
                    writer.add_scalar(f"val_ap/{cls}", ap, epoch)
                writer.add_scalar("val/mAP", mean_ap, epoch)
                state = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "epoch": epoch, "best_map": max(best_map, mean_ap)}
                torch.save(state, os.path.join(args.save_folder, "ssd300_last.pth"))
                if mean_ap > best_map:
                    best_map = mean_ap
                    torch.save(state, os.path.join(args.save_folder, "ssd300_best.pth"))
            dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
