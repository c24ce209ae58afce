"""EfficientNet-B3 plant disease classifier (PlantVillage-style folder, no official split).

DeepSpeed ZeRO-2, fp16. 90/10 train/val split made in the script.

    deepspeed --num_gpus 4 14_efficientnet_plant_disease.py --data /data/plant_village/color
"""
import argparse
import os
import random
import time

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, random_split
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--img-size", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--save-dir", default="checkpoints/effnet_b3_plants")
    parser.add_argument("--local_rank", type=int, default=-1)
    return parser.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class TransformSubset(Dataset):
    """random_split returns Subsets that share the parent's transform; give each its own."""

    def __init__(self, subset, transform):
        self.subset = subset
        self.transform = transform

    def __len__(self):
        return len(self.subset)

    def __getitem__(self, i):
        img, label = self.subset[i]
        return self.transform(img), label


def build_data(args):
    base = datasets.ImageFolder(args.data)  # PIL images, no transform
    n_val = int(len(base) * args.val_fraction)
    train_sub, val_sub = random_split(base, [len(base) - n_val, n_val])
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(args.img_size, scale=(0.5, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.RandomVerticalFlip(),
        transforms.ColorJitter(0.3, 0.3, 0.3),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    val_tf = transforms.Compose([
        transforms.Resize(int(args.img_size * 1.14)),
        transforms.CenterCrop(args.img_size),
        transforms.ToTensor(),
        transforms.Normalize(mean, std),
    ])
    return TransformSubset(train_sub, train_tf), TransformSubset(val_sub, val_tf), base.classes


def main():
    args = parse_args()
    deepspeed.init_distributed()
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    set_seed(args.seed + rank)

    train_set, val_set, classes = build_data(args)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=96, sampler=val_sampler, num_workers=8, pin_memory=True)

    model = models.efficientnet_b3(weights=models.EfficientNet_B3_Weights.IMAGENET1K_V1)
    model.classifier[1] = nn.Linear(model.classifier[1].in_features, len(classes))

    steps = len(train_loader) * args.epochs
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 1e-4}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                 "warmup_num_steps": len(train_loader), "total_num_steps": steps}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
        "gradient_clipping": 2.0,
        "steps_per_print": 200,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.05)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"{len(classes)} classes, {len(train_set)} train / {len(val_set)} val images, "
              f"world size {world_size}", flush=True)

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        engine.train()
        tic = time.time()
        for step, (images, labels) in enumerate(train_loader):
            images = images.to(engine.device, non_blocking=True).half()
            labels = labels.to(engine.device, non_blocking=True)
            loss = criterion(engine(images).float(), labels)
            engine.backward(loss)
            engine.step()
            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f}", flush=True)

        engine.eval()
        stats = torch.zeros(2, device=engine.device)
        with torch.no_grad():
            for images, labels in val_loader:
                images = images.to(engine.device, non_blocking=True).half()
                labels = labels.to(engine.device, non_blocking=True)
                stats[0] += (engine(images).argmax(1) == labels).sum()
                stats[1] += labels.numel()
        dist.all_reduce(stats)
        acc = (stats[0] / stats[1]).item()
        if rank == 0:
            print(f"epoch {epoch} val acc {acc:.4f} ({time.time() - tic:.0f}s)", flush=True)

        engine.save_checkpoint(args.save_dir, tag="latest", client_state={"epoch": epoch, "acc": acc})
        if acc > best_acc:
            best_acc = acc
            if rank == 0:
                torch.save({"state_dict": {k: v.float().cpu() for k, v in engine.module.state_dict().items()},
                            "classes": classes}, os.path.join(args.save_dir, "best.pth"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
