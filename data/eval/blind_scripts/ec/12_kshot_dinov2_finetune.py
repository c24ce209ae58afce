"""K-shot fine-tuning benchmark for new product introductions.

When a new part goes into production we only have a handful of labelled
defect images per class. This script simulates that: from the labelled pool
of a part it draws K images per class for training, the remaining images are
the test set. A DINOv2 ViT-S/14 backbone (timm) is fine-tuned with a linear head.

    torchrun --nproc_per_node=4 12_kshot_dinov2_finetune.py --pool /data/npi/housing_v7 --shots 10 \
        --out /shared/npi_runs/housing_v7_k10
"""
import argparse
import json
import os
import random
from collections import defaultdict

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import balanced_accuracy_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--pool", required=True, help="<pool>/<class_name>/*.png")
    p.add_argument("--out", required=True)
    p.add_argument("--shots", type=int, default=10)
    p.add_argument("--backbone", default="vit_small_patch14_dinov2.lvd142m")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32, help="global, split across GPUs")
    p.add_argument("--lr-head", type=float, default=1e-3)
    p.add_argument("--lr-backbone", type=float, default=1e-5)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=2024)
    return p.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def kshot_split(pool_dir, shots):
    classes = sorted(d for d in os.listdir(pool_dir) if os.path.isdir(os.path.join(pool_dir, d)))
    train, test = [], []
    for ci, c in enumerate(classes):
        files = sorted(os.path.join(pool_dir, c, f) for f in os.listdir(os.path.join(pool_dir, c))
                       if f.lower().endswith((".png", ".jpg")))
        picked = set(random.sample(range(len(files)), shots))
        for i, f in enumerate(files):
            (train if i in picked else test).append((f, ci))
    return classes, train, test


class ListDataset(Dataset):
    def __init__(self, items, tf):
        self.items, self.tf = items, tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, y = self.items[i]
        return self.tf(Image.open(path).convert("RGB")), y


def build_model(name, num_classes):
    model = timm.create_model(name, pretrained=True, num_classes=num_classes, img_size=224)
    head_ids = {id(p) for p in model.get_classifier().parameters()}
    backbone_params = [p for p in model.parameters() if id(p) not in head_ids]
    head_params = [p for p in model.parameters() if id(p) in head_ids]
    return model, backbone_params, head_params


@torch.no_grad()
def evaluate(model, items, tf, device, rank, world, batch_size):
    """Strided split of the test list, predictions gathered on every rank."""
    mine = items[rank::world]
    loader = DataLoader(ListDataset(mine, tf), batch_size=batch_size, num_workers=4)
    model.eval()
    preds = []
    for x, _ in loader:
        preds.append(model(x.to(device)).argmax(1).cpu())
    model.train()
    preds = torch.cat(preds).tolist() if preds else []
    gathered = [None] * world
    dist.all_gather_object(gathered, preds)
    y_pred, y_true = [], []
    for r in range(world):
        y_pred += gathered[r]
        y_true += [y for _, y in items[r::world]]
    return balanced_accuracy_score(y_true, y_pred)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # different augmentation streams on each GPU
    set_seed(args.seed + rank)

    classes, train_items, test_items = kshot_split(args.pool, args.shots)
    if rank == 0:
        print(f"{len(classes)} classes, {len(train_items)} train ({args.shots}-shot), {len(test_items)} test")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "split.json"), "w") as f:
            json.dump({"classes": classes, "train": train_items, "test": test_items}, f, indent=1)

    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.5, 1.0)), transforms.RandomHorizontalFlip(),
        transforms.RandomVerticalFlip(), transforms.RandomRotation(15),
        transforms.ColorJitter(0.3, 0.3, 0.2), transforms.ToTensor(), transforms.Normalize(mean, std)])
    test_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(),
                                  transforms.Normalize(mean, std)])

    train_ds = ListDataset(train_items, train_tf)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.batch_size // world, sampler=sampler, num_workers=args.workers,
                        pin_memory=True)

    model, backbone_params, head_params = build_model(args.backbone, len(classes))
    model = DDP(model.to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW([{"params": backbone_params, "lr": args.lr_backbone},
                             {"params": head_params, "lr": args.lr_head}], weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    history, best = [], 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        sched.step()
        dist.all_reduce(tot)

        if (epoch + 1) % 10 == 0 or epoch + 1 == args.epochs:
            bacc = evaluate(model.module, test_items, test_tf, device, rank, world, 64)
            if rank == 0:
                history.append({"epoch": epoch, "loss": (tot[0] / tot[1]).item(), "balanced_acc": bacc})
                print(f"epoch {epoch}: loss {(tot[0] / tot[1]).item():.4f} balanced acc {bacc:.4f}", flush=True)
                if bacc > best:
                    best = bacc
                    torch.save({"model": model.module.state_dict(), "classes": classes},
                               os.path.join(args.out, "best.pt"))

    if rank == 0:
        with open(os.path.join(args.out, "history.json"), "w") as f:
            json.dump({"history": history, "best_balanced_acc": best}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
