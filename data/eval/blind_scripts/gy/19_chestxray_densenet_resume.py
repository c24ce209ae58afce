#!/usr/bin/env python3
"""
Pneumonia vs normal on the Kaggle chest-xray dataset (Paul Mooney), DenseNet-121.
Two workstations, one GPU each, checkpoints on the shared NFS export
(/srv/share is mounted on both), so either box can resume.

  ws1 (192.168.4.11, RTX A4000) node_rank 0
  ws2 (192.168.4.12, RTX 3060)  node_rank 1

  torchrun --nnodes=2 --nproc_per_node=1 --node_rank=R --master_addr=192.168.4.11 \
      --master_port=29510 xray_densenet.py [--resume]
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/srv/share/data/chest_xray")
    p.add_argument("--ckpt-dir", default="/srv/share/runs/xray_densenet")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--bs", type=int, default=24)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


def transforms_for(train):
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    if train:
        return transforms.Compose([
            transforms.Grayscale(num_output_channels=3),
            transforms.RandomResizedCrop(256, scale=(0.7, 1.0), ratio=(0.9, 1.1)),
            transforms.RandomRotation(7),
            transforms.ColorJitter(brightness=0.15, contrast=0.15),
            transforms.ToTensor(),
            norm,
        ])
    return transforms.Compose([
        transforms.Grayscale(num_output_channels=3),
        transforms.Resize(288),
        transforms.CenterCrop(256),
        transforms.ToTensor(),
        norm,
    ])


def build_model():
    net = models.densenet121(weights=models.DenseNet121_Weights.IMAGENET1K_V1)
    net.classifier = nn.Linear(net.classifier.in_features, 1)
    return net


@torch.no_grad()
def gather_predictions(model, loader, device, world):
    """Collect (score, label) from every rank so AUC is computed on the whole test set."""
    model.eval()
    scores, labels = [], []
    for x, y in loader:
        scores.append(torch.sigmoid(model(x.to(device, non_blocking=True)).squeeze(1)).float())
        labels.append(y.to(device).float())
    local = torch.stack([torch.cat(scores), torch.cat(labels)])
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    allp = torch.cat(gathered, dim=1).cpu().numpy()
    return allp[0], allp[1]


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), transforms_for(True))
    test_set = datasets.ImageFolder(os.path.join(args.data, "test"), transforms_for(False))
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    # test set is 624 images = divisible by 2, so the sampler adds no padding
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=48, sampler=test_sampler,
                             num_workers=args.workers, pin_memory=True)

    # class imbalance: ~3x more pneumonia than normal
    targets = np.array(train_set.targets)
    pos_weight = torch.tensor([(targets == 0).sum() / max((targets == 1).sum(), 1)], device=device)
    criterion = nn.BCEWithLogitsLoss(pos_weight=pos_weight)

    model = build_model().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.3)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best_auc = 0, 0.0
    last_path = os.path.join(args.ckpt_dir, "last.pt")
    if args.resume and os.path.isfile(last_path):
        ckpt = torch.load(last_path, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_auc = ckpt["epoch"] + 1, ckpt["best_auc"]
        if rank == 0:
            print(f"resumed at epoch {start_epoch}, best auc so far {best_auc:.4f}")

    model = DDP(model, device_ids=[local_rank])
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        for x, y in train_loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True).float()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(x).squeeze(1), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            agg += torch.stack([loss.detach().float() * y.numel(), torch.tensor(float(y.numel()), device=device)])
        scheduler.step()
        dist.all_reduce(agg)

        probs, labels = gather_predictions(model, test_loader, device, world)
        if rank == 0:
            auc = roc_auc_score(labels, probs)
            acc = ((probs > 0.5) == labels).mean()
            print(f"epoch {epoch}: loss {(agg[0] / agg[1]).item():.4f} test auc {auc:.4f} acc {acc:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            best_auc = max(best_auc, auc)
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
                "epoch": epoch,
                "best_auc": best_auc,
            }
            torch.save(state, last_path)
            if auc >= best_auc:
                torch.save(state, os.path.join(args.ckpt_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
