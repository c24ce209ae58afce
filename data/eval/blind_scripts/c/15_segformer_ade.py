# -*- coding: utf-8 -*-
"""
SegFormer-B2 语义分割训练 (ADE20K, 150 类), 基于 transformers
    torchrun --nproc_per_node=8 train_segformer.py --cfg configs/segformer_b2_ade.yaml
"""
import os
import time
import random
import argparse

import cv2
import yaml
import numpy as np
from easydict import EasyDict as edict

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import SegformerForSemanticSegmentation

MEAN = np.array([123.675, 116.28, 103.53], dtype=np.float32)
STD = np.array([58.395, 57.12, 57.375], dtype=np.float32)


class ADE20K(Dataset):
    def __init__(self, root, split, crop=512, train=True):
        self.img_dir = os.path.join(root, "images", split)
        self.ann_dir = os.path.join(root, "annotations", split)
        self.names = sorted(f[:-4] for f in os.listdir(self.img_dir) if f.endswith(".jpg"))
        self.crop, self.train = crop, train

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        img = cv2.imread(os.path.join(self.img_dir, self.names[i] + ".jpg"))[:, :, ::-1].astype(np.float32)
        seg = cv2.imread(os.path.join(self.ann_dir, self.names[i] + ".png"), cv2.IMREAD_GRAYSCALE).astype(np.int64)
        seg = seg - 1
        seg[seg == -1] = 255  # reduce_zero_label
        if self.train:
            s = random.uniform(0.5, 2.0) * 512 / min(img.shape[:2])
            img = cv2.resize(img, None, fx=s, fy=s, interpolation=cv2.INTER_LINEAR)
            seg = cv2.resize(seg.astype(np.uint8), None, fx=s, fy=s, interpolation=cv2.INTER_NEAREST).astype(np.int64)
            ph, pw = max(self.crop - img.shape[0], 0), max(self.crop - img.shape[1], 0)
            img = np.pad(img, ((0, ph), (0, pw), (0, 0)))
            seg = np.pad(seg, ((0, ph), (0, pw)), constant_values=255)
            y = random.randint(0, img.shape[0] - self.crop)
            x = random.randint(0, img.shape[1] - self.crop)
            img, seg = img[y:y + self.crop, x:x + self.crop], seg[y:y + self.crop, x:x + self.crop]
            if random.random() < 0.5:
                img, seg = img[:, ::-1], seg[:, ::-1]
        else:
            s = 512 / min(img.shape[:2])
            img = cv2.resize(img, None, fx=s, fy=s, interpolation=cv2.INTER_LINEAR)
        img = (img - MEAN) / STD
        return torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))), torch.from_numpy(np.ascontiguousarray(seg))


def intersect_and_union(pred, label, num_classes, ignore_index=255):
    mask = label != ignore_index
    pred, label = pred[mask], label[mask]
    inter = pred[pred == label]
    area_inter = np.bincount(inter, minlength=num_classes)
    area_pred = np.bincount(pred, minlength=num_classes)
    area_label = np.bincount(label, minlength=num_classes)
    return area_inter, area_pred + area_label - area_inter, area_label


@torch.no_grad()
def evaluate(model, loader, num_classes, device):
    model.eval()
    total_inter = np.zeros(num_classes, dtype=np.int64)
    total_union = np.zeros(num_classes, dtype=np.int64)
    total_label = np.zeros(num_classes, dtype=np.int64)
    for img, seg in loader:
        logits = model(pixel_values=img.to(device)).logits
        logits = F.interpolate(logits, size=seg.shape[-2:], mode="bilinear", align_corners=False)
        pred = logits.argmax(1).cpu().numpy()
        for p, l in zip(pred, seg.numpy()):
            i, u, a = intersect_and_union(p.ravel(), l.ravel(), num_classes)
            total_inter += i
            total_union += u
            total_label += a
    # 多卡结果求和
    results = torch.from_numpy(np.stack([total_inter, total_union, total_label]))
    dist.all_reduce(results, op=dist.ReduceOp.SUM)
    results = results.numpy().astype(np.float64)
    iou = results[0] / np.maximum(results[1], 1)
    acc = results[0].sum() / max(results[2].sum(), 1)
    model.train()
    return np.nanmean(iou[results[2] > 0]), acc


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", default="configs/segformer_b2_ade.yaml")
    args = parser.parse_args()
    with open(args.cfg) as f:
        cfg = edict(yaml.safe_load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed + rank)

    train_set = ADE20K(cfg.data_root, "training", cfg.crop_size, train=True)
    val_set = ADE20K(cfg.data_root, "validation", train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=cfg.samples_per_gpu, sampler=train_sampler,
                              num_workers=cfg.workers_per_gpu, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=cfg.workers_per_gpu)

    model = SegformerForSemanticSegmentation.from_pretrained(
        cfg.pretrained, num_labels=150, ignore_mismatched_sizes=True)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    # mmseg 默认: AdamW lr 6e-5 (8 卡 x 2), head 的 lr 乘 10
    lr = cfg.lr * cfg.samples_per_gpu * world_size / 16
    head_params = [p for n, p in model.module.named_parameters() if n.startswith("decode_head")]
    backbone_params = [p for n, p in model.module.named_parameters() if not n.startswith("decode_head")]
    optimizer = torch.optim.AdamW([{"params": backbone_params, "lr": lr},
                                   {"params": head_params, "lr": lr * 10}], lr=lr, weight_decay=0.01)
    max_iters = cfg.max_iters
    warmup = 1500

    def lr_lambda(it):
        if it < warmup:
            return 1e-6 + (1 - 1e-6) * it / warmup
        return (1 - (it - warmup) / (max_iters - warmup)) ** 1.0

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    if rank == 0:
        os.makedirs(cfg.work_dir, exist_ok=True)

    it, epoch, best = 0, 0, 0.0
    t0 = time.time()
    while it < max_iters:
        train_sampler.set_epoch(epoch)
        for img, seg in train_loader:
            img, seg = img.to(device, non_blocking=True), seg.to(device, non_blocking=True)
            out = model(pixel_values=img)
            logits = F.interpolate(out.logits, size=seg.shape[-2:], mode="bilinear", align_corners=False)
            loss = F.cross_entropy(logits, seg, ignore_index=255)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            it += 1
            if it % 50 == 0 and rank == 0:
                print(f"Iter [{it}/{max_iters}] lr: {scheduler.get_last_lr()[0]:.3e}, "
                      f"loss: {loss.item():.4f}, time: {(time.time() - t0) / 50:.3f}")
                t0 = time.time()
            if it % cfg.eval_interval == 0 or it == max_iters:
                miou, acc = evaluate(model, val_loader, 150, device)
                if rank == 0:
                    print(f"[Eval] iter {it}: mIoU {miou:.4f} aAcc {acc:.4f}")
                    torch.save(model.module.state_dict(), os.path.join(cfg.work_dir, "latest.pth"))
                    if miou > best:
                        best = miou
                        torch.save(model.module.state_dict(), os.path.join(cfg.work_dir, "best_mIoU.pth"))
                dist.barrier()
            if it >= max_iters:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
