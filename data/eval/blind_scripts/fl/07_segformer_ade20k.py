"""SegFormer-B5 semantic segmentation on ADE20K with DeepSpeed (ZeRO-2, fp16).

Usage:
    deepspeed --num_gpus 8 07_segformer_ade20k.py --root /data/ADEChallengeData2016 \
        --batch-size 4 --accum 2 --iters 160000
"""
import argparse
import glob
import os

import albumentations as A
import cv2
import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from albumentations.pytorch import ToTensorV2
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import SegformerForSemanticSegmentation

NUM_CLASSES = 150
IGNORE = 255

DS_CONFIG = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 6e-5, "betas": [0.9, 0.999], "weight_decay": 0.01},
    },
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2},
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "reduce_scatter": True,
        "overlap_comm": True,
        "contiguous_gradients": True,
    },
    "gradient_clipping": 1.0,
    "steps_per_print": 500,
}


class ADE20K(Dataset):
    def __init__(self, root, split, transform):
        self.images = sorted(glob.glob(os.path.join(root, "images", split, "*.jpg")))
        self.masks = [p.replace("/images/", "/annotations/").replace(".jpg", ".png") for p in self.images]
        self.transform = transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = cv2.cvtColor(cv2.imread(self.images[i]), cv2.COLOR_BGR2RGB)
        mask = cv2.imread(self.masks[i], cv2.IMREAD_GRAYSCALE).astype(np.int64)
        mask = mask - 1  # 0 = "other" -> ignore
        mask[mask < 0] = IGNORE
        out = self.transform(image=img, mask=mask)
        return out["image"], out["mask"].long()


def transforms(train, size=640):
    norm = A.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    if train:
        return A.Compose([
            A.RandomScale(scale_limit=(-0.5, 1.0)),
            A.PadIfNeeded(size, size, border_mode=cv2.BORDER_CONSTANT, value=0, mask_value=IGNORE),
            A.RandomCrop(size, size),
            A.HorizontalFlip(),
            A.ColorJitter(0.2, 0.2, 0.2, 0.05, p=0.5),
            norm, ToTensorV2(),
        ])
    return A.Compose([A.LongestMaxSize(size), A.PadIfNeeded(size, size, border_mode=cv2.BORDER_CONSTANT,
                                                             value=0, mask_value=IGNORE),
                      norm, ToTensorV2()])


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--pretrained", default="nvidia/mit-b5")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--iters", type=int, default=160_000)
    p.add_argument("--eval-every", type=int, default=8000)
    p.add_argument("--out", default="work_dirs/segformer_b5")
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


def forward_logits(engine, images):
    logits = engine(pixel_values=images).logits  # 1/4 resolution
    return F.interpolate(logits.float(), size=images.shape[-2:], mode="bilinear", align_corners=False)


@torch.no_grad()
def evaluate(engine, loader):
    engine.eval()
    hist = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.float64, device=engine.device)
    for images, masks in loader:
        images = images.to(engine.device).half()
        masks = masks.to(engine.device)
        pred = forward_logits(engine, images).argmax(1)
        valid = masks != IGNORE
        idx = masks[valid] * NUM_CLASSES + pred[valid]
        hist += torch.bincount(idx, minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES).double()
    dist.all_reduce(hist)
    iou = hist.diag() / (hist.sum(0) + hist.sum(1) - hist.diag()).clamp(min=1)
    engine.train()
    return iou.mean().item(), (hist.diag().sum() / hist.sum()).item()


def main():
    args = get_args()
    deepspeed.init_distributed()
    rank = dist.get_rank()

    train_set = ADE20K(args.root, "training", transforms(train=True))
    val_set = ADE20K(args.root, "validation", transforms(train=False))
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=4)

    model = SegformerForSemanticSegmentation.from_pretrained(
        args.pretrained, num_labels=NUM_CLASSES, ignore_mismatched_sizes=True)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)

    ds_config = dict(DS_CONFIG)
    ds_config["train_micro_batch_size_per_gpu"] = args.batch_size
    ds_config["gradient_accumulation_steps"] = args.accum
    ds_config["scheduler"] = {
        "type": "WarmupDecayLR",
        "params": {"warmup_min_lr": 1e-7, "warmup_max_lr": 6e-5,
                   "warmup_num_steps": 1500, "total_num_steps": args.iters // args.accum},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config)
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE)

    it, epoch, best_miou = 0, 0, 0.0
    while it < args.iters:
        train_sampler.set_epoch(epoch)
        for images, masks in train_loader:
            images = images.to(engine.device, non_blocking=True).half()
            masks = masks.to(engine.device, non_blocking=True)
            loss = criterion(forward_logits(engine, images), masks)
            engine.backward(loss)
            engine.step()
            it += 1
            if rank == 0 and it % 100 == 0:
                print(f"iter {it}/{args.iters} loss {loss.item():.4f} "
                      f"lr {engine.get_lr()[0]:.2e}", flush=True)
            if it % args.eval_every == 0 or it == args.iters:
                miou, acc = evaluate(engine, val_loader)
                if rank == 0:
                    print(f"iter {it}: mIoU {miou * 100:.2f} aAcc {acc * 100:.2f}", flush=True)
                engine.save_checkpoint(args.out, tag=f"iter_{it}", client_state={"iter": it, "miou": miou})
                if miou > best_miou:
                    best_miou = miou
                    if rank == 0:
                        engine.module.save_pretrained(os.path.join(args.out, "best_hf"))
            if it >= args.iters:
                break
        epoch += 1

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
