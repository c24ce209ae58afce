# -*- coding: utf-8 -*-
"""
DeepLabV3 语义分割训练脚本 (VOC2012 aug)
启动方式:
    torchrun --nproc_per_node=4 train_deeplab.py --cfg configs/voc_r50.yaml
"""
import os
import time
import argparse
import logging

import yaml
import numpy as np
from PIL import Image
from easydict import EasyDict as edict

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision.models.segmentation import deeplabv3_resnet50
import torchvision.transforms.functional as TF

logger = logging.getLogger("deeplab")


def parse_args():
    parser = argparse.ArgumentParser(description="DeepLabV3 分布式训练")
    parser.add_argument("--cfg", type=str, default="configs/voc_r50.yaml")
    parser.add_argument("--resume", type=str, default="")
    return parser.parse_args()


def load_cfg(path):
    with open(path, "r", encoding="utf-8") as f:
        cfg = edict(yaml.safe_load(f))
    return cfg


def is_main_process():
    return not dist.is_initialized() or dist.get_rank() == 0


def setup_logger(save_dir):
    logger.setLevel(logging.INFO if is_main_process() else logging.WARNING)
    fmt = logging.Formatter("[%(asctime)s] %(message)s", "%m-%d %H:%M:%S")
    sh = logging.StreamHandler()
    sh.setFormatter(fmt)
    logger.addHandler(sh)
    if is_main_process():
        os.makedirs(save_dir, exist_ok=True)
        fh = logging.FileHandler(os.path.join(save_dir, "train.log"))
        fh.setFormatter(fmt)
        logger.addHandler(fh)


class VOCSegDataset(Dataset):
    """VOC 格式的数据集, list 文件每行一个图片名"""
    MEAN = [0.485, 0.456, 0.406]
    STD = [0.229, 0.224, 0.225]

    def __init__(self, root, split="train_aug", crop_size=512, train=True):
        self.root = root
        self.train = train
        self.crop_size = crop_size
        with open(os.path.join(root, "ImageSets/Segmentation", split + ".txt")) as f:
            self.names = [x.strip() for x in f if x.strip()]

    def __len__(self):
        return len(self.names)

    def __getitem__(self, idx):
        name = self.names[idx]
        img = Image.open(os.path.join(self.root, "JPEGImages", name + ".jpg")).convert("RGB")
        mask = Image.open(os.path.join(self.root, "SegmentationClassAug", name + ".png"))
        if self.train:
            # 随机缩放 + 随机裁剪 + 随机翻转
            scale = np.random.uniform(0.5, 2.0)
            w, h = img.size
            nw, nh = int(w * scale), int(h * scale)
            img = img.resize((nw, nh), Image.BILINEAR)
            mask = mask.resize((nw, nh), Image.NEAREST)
            pad_w, pad_h = max(self.crop_size - nw, 0), max(self.crop_size - nh, 0)
            if pad_w > 0 or pad_h > 0:
                img = TF.pad(img, [0, 0, pad_w, pad_h], fill=0)
                mask = TF.pad(mask, [0, 0, pad_w, pad_h], fill=255)
            w, h = img.size
            x = np.random.randint(0, w - self.crop_size + 1)
            y = np.random.randint(0, h - self.crop_size + 1)
            img = img.crop((x, y, x + self.crop_size, y + self.crop_size))
            mask = mask.crop((x, y, x + self.crop_size, y + self.crop_size))
            if np.random.rand() < 0.5:
                img, mask = TF.hflip(img), TF.hflip(mask)
        img = TF.normalize(TF.to_tensor(img), self.MEAN, self.STD)
        mask = torch.from_numpy(np.array(mask, dtype=np.int64))
        return img, mask


def fast_hist(pred, label, n):
    k = (label >= 0) & (label < n)
    return torch.bincount(n * label[k] + pred[k], minlength=n ** 2).reshape(n, n)


@torch.no_grad()
def evaluate(model, loader, device, num_classes):
    model.eval()
    hist = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
    for img, mask in loader:
        img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
        out = model(img)["out"]
        out = F.interpolate(out, size=mask.shape[-2:], mode="bilinear", align_corners=False)
        hist += fast_hist(out.argmax(1).flatten(), mask.flatten(), num_classes)
    # 汇总所有卡上的混淆矩阵
    dist.all_reduce(hist, op=dist.ReduceOp.SUM)
    hist = hist.double()
    iou = torch.diag(hist) / (hist.sum(0) + hist.sum(1) - torch.diag(hist) + 1e-10)
    model.train()
    return iou.mean().item(), iou.cpu().numpy()


def main():
    args = parse_args()
    cfg = load_cfg(args.cfg)

    # ---------------- 分布式初始化 ----------------
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")

    setup_logger(cfg.OUTPUT_DIR)
    logger.info("world_size=%d, cfg=%s", world_size, cfg)
    torch.manual_seed(cfg.SEED + rank)
    np.random.seed(cfg.SEED + rank)

    train_set = VOCSegDataset(cfg.DATA_ROOT, "train_aug", cfg.CROP_SIZE, train=True)
    val_set = VOCSegDataset(cfg.DATA_ROOT, "val", cfg.CROP_SIZE, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=cfg.BATCH_SIZE_PER_GPU, sampler=train_sampler,
                              num_workers=cfg.WORKERS, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=val_sampler, num_workers=2)

    model = deeplabv3_resnet50(weights=None, weights_backbone="IMAGENET1K_V1",
                               num_classes=cfg.NUM_CLASSES, aux_loss=True)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    # 学习率按总 batch 线性缩放 (base lr 对应 16 张图)
    lr = cfg.BASE_LR * cfg.BATCH_SIZE_PER_GPU * world_size / 16
    params = [
        {"params": model.module.backbone.parameters(), "lr": lr},
        {"params": model.module.classifier.parameters(), "lr": lr * 10},
        {"params": model.module.aux_classifier.parameters(), "lr": lr * 10},
    ]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=cfg.WEIGHT_DECAY)
    criterion = nn.CrossEntropyLoss(ignore_index=255)
    max_iter = cfg.EPOCHS * len(train_loader)

    start_epoch, best_miou = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best_miou = ckpt["epoch"] + 1, ckpt.get("best_miou", 0.0)
        logger.info("从 %s 恢复训练, epoch=%d", args.resume, start_epoch)

    cur_iter = start_epoch * len(train_loader)
    for epoch in range(start_epoch, cfg.EPOCHS):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for i, (img, mask) in enumerate(train_loader):
            # poly 学习率
            factor = (1 - cur_iter / max_iter) ** 0.9
            for j, g in enumerate(optimizer.param_groups):
                g["lr"] = lr * factor * (1 if j == 0 else 10)
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            out = model(img)
            loss = criterion(out["out"], mask) + 0.4 * criterion(out["aux"], mask)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            cur_iter += 1
            if i % cfg.PRINT_FREQ == 0:
                logger.info("Epoch[%d][%d/%d] loss: %.4f lr: %.6f time: %.2fs", epoch, i,
                            len(train_loader), loss.item(), optimizer.param_groups[0]["lr"],
                            time.time() - tic)
                tic = time.time()

        miou, ious = evaluate(model, val_loader, device, cfg.NUM_CLASSES)
        logger.info("Epoch %d 验证 mIoU: %.4f", epoch, miou)
        if is_main_process():
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch, "best_miou": max(best_miou, miou)}
            torch.save(state, os.path.join(cfg.OUTPUT_DIR, "last.pth"))
            if miou > best_miou:
                torch.save(state, os.path.join(cfg.OUTPUT_DIR, "best.pth"))
                logger.info("保存最优模型, mIoU %.4f -> %.4f", best_miou, miou)
        best_miou = max(best_miou, miou)
        dist.barrier()

    logger.info("训练结束, best mIoU = %.4f", best_miou)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
