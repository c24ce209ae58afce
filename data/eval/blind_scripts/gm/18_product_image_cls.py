# -*- coding: utf-8 -*-
"""
商品主图类目分类（ResNet50，~600 个二级类目），训练完成后自动导出 TorchScript 给在线服务

目录结构（ImageFolder 格式）：
    /mnt/oss/mall-cv/cate_cls/v3/{train,val}/<类目id>/*.jpg
启动：
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29400 \
        18_product_image_cls.py --cfg configs/r50_cate_v3.yaml
"""
import os
import time
import argparse
import logging

import yaml
import torch
import torch.nn as nn
import torch.distributed as dist
import torchvision
import torchvision.transforms as T
from torchvision.datasets import ImageFolder
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from cv_platform.reporter import DashboardReporter

logger = logging.getLogger("cate_cls")


def build_transforms(size):
    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = T.Compose([T.RandomResizedCrop(size, scale=(0.35, 1.0)), T.RandomHorizontalFlip(),
                          T.ColorJitter(0.2, 0.2, 0.2), T.ToTensor(), normalize])
    val_tf = T.Compose([T.Resize(int(size * 1.14)), T.CenterCrop(size), T.ToTensor(), normalize])
    return train_tf, val_tf


def build_model(num_classes, pretrained=True):
    model = torchvision.models.resnet50(weights="IMAGENET1K_V2" if pretrained else None)
    model.fc = nn.Linear(model.fc.in_features, num_classes)
    return model


@torch.no_grad()
def validate(model, val_set, device, bs, workers):
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=bs,
                        num_workers=workers, pin_memory=True)
    stat = torch.zeros(3, device=device)
    for img, y in loader:
        img, y = img.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model.module(img)
        top5 = out.topk(5, 1).indices
        stat[0] += (top5[:, 0] == y).sum()
        stat[1] += (top5 == y[:, None]).any(1).sum()
        stat[2] += y.numel()
    dist.all_reduce(stat)
    model.train()
    return (stat[0] / stat[2]).item(), (stat[1] / stat[2]).item()


def export_torchscript(ckpt_path, num_classes, size, out_path):
    """导出给 serving 的 TorchScript 模型（单卡、CPU 上做即可）"""
    model = build_model(num_classes, pretrained=False)
    model.load_state_dict(torch.load(ckpt_path, map_location="cpu"))
    model.eval()
    example = torch.randn(1, 3, size, size)
    traced = torch.jit.trace(model, example)
    traced.save(out_path)
    logger.info("TorchScript 导出完成: %s", out_path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    torch.backends.cudnn.benchmark = True

    out_dir = cfg["output_dir"]  # OSS 挂载目录，所有节点可见
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        reporter = DashboardReporter(project="mall_cate_cls", run_name=cfg["run_name"])

    train_tf, val_tf = build_transforms(cfg["img_size"])
    train_set = ImageFolder(os.path.join(cfg["data_root"], "train"), transform=train_tf)
    val_set = ImageFolder(os.path.join(cfg["data_root"], "val"), transform=val_tf)
    assert train_set.class_to_idx == val_set.class_to_idx, "训练集和验证集类目不一致"
    num_classes = len(train_set.classes)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=sampler, num_workers=cfg["workers"],
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = build_model(num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    base_lr = cfg["base_lr"] * cfg["batch_size"] * world / 256  # 线性缩放
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=base_lr, epochs=cfg["epochs"],
                                                    steps_per_epoch=len(loader), pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    best_top1 = 0.0
    best_path = os.path.join(out_dir, "best.pth")
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (img, y) in enumerate(loader):
            img, y = img.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(img), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if it % cfg["print_freq"] == 0:
                ips = cfg["print_freq"] * cfg["batch_size"] * world / (time.time() - t0)
                logger.info("Epoch[%d] [%d/%d] loss %.4f lr %.5f %.0f img/s", epoch, it, len(loader),
                            loss.item(), scheduler.get_last_lr()[0], ips)
                t0 = time.time()

        top1, top5 = validate(model, val_set, device, cfg["batch_size"], cfg["workers"])
        logger.info("Epoch[%d] val top1 %.4f top5 %.4f", epoch, top1, top5)
        if rank == 0:
            reporter.log({"val_top1": top1, "val_top5": top5, "epoch": epoch})
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(out_dir, "checkpoint.pth"))
            if top1 > best_top1:
                best_top1 = top1
                torch.save(model.state_dict(), best_path)
                logger.info("best top1 %.4f -> %s", best_top1, best_path)
        dist.barrier()

    if rank == 0:
        export_torchscript(best_path, num_classes, cfg["img_size"], os.path.join(out_dir, "cate_cls_r50.pt"))
        reporter.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
