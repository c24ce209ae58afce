"""Multi-label chest X-ray classifier (ViT-B/16) - SageMaker training script.

estimator = PyTorch(
    entry_point="train_cxr.py", source_dir="src", role=role,
    instance_type="ml.p4d.24xlarge", instance_count=2,
    framework_version="2.2", py_version="py310",
    distribution={"torch_distributed": {"enabled": True}},   # torchrun on every instance
    hyperparameters={"epochs": 15, "batch-size": 32, "lr": 1e-4},
)
estimator.fit({"train": "s3://cxr-data/train", "val": "s3://cxr-data/val"})
"""
import argparse
import logging
import os
import sys

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

logger = logging.getLogger(__name__)
logger.addHandler(logging.StreamHandler(sys.stdout))

FINDINGS = ["Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Effusion",
            "Emphysema", "Fibrosis", "Infiltration", "Mass", "Nodule", "Pleural_Thickening",
            "Pneumonia", "Pneumothorax", "Hernia"]


class CXRDataset(Dataset):
    def __init__(self, root, transform):
        self.root = root
        self.df = pd.read_csv(os.path.join(root, "labels.csv"))
        self.transform = transform

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        row = self.df.iloc[i]
        img = Image.open(os.path.join(self.root, "images", row["image"])).convert("RGB")
        target = torch.tensor(row[FINDINGS].values.astype(np.float32))
        return self.transform(img), target


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--model", type=str, default="vit_base_patch16_224.augreg_in21k")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--train", type=str, default=os.environ.get("SM_CHANNEL_TRAIN"))
    ap.add_argument("--val", type=str, default=os.environ.get("SM_CHANNEL_VAL"))
    ap.add_argument("--model-dir", type=str, default=os.environ.get("SM_MODEL_DIR"))
    return ap.parse_args()


def validate(model, loader, device):
    model.eval()
    scores, targets = [], []
    with torch.no_grad():
        for x, y in loader:
            x = x.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            scores.append(torch.sigmoid(logits.float()).cpu())
            targets.append(y)
    scores = torch.cat(scores).numpy()
    targets = torch.cat(targets).numpy()
    aucs = []
    for k in range(len(FINDINGS)):
        if targets[:, k].min() != targets[:, k].max():
            aucs.append(roc_auc_score(targets[:, k], scores[:, k]))
    model.train()
    return float(np.mean(aucs))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)

    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.7, 1.0)),
        transforms.RandomRotation(7),
        transforms.ToTensor(),
        transforms.Normalize([0.5] * 3, [0.5] * 3),
    ])
    val_tf = transforms.Compose([
        transforms.Resize(224),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize([0.5] * 3, [0.5] * 3),
    ])
    train_ds = CXRDataset(args.train, train_tf)
    val_ds = CXRDataset(args.val, val_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, pretrained=True, num_classes=len(FINDINGS),
                              drop_path_rate=0.1)
    model = DDP(model.to(device), device_ids=[local_rank])

    pos_frac = torch.tensor(train_ds.df[FINDINGS].values.mean(0), dtype=torch.float32)
    pos_weight = ((1 - pos_frac) / pos_frac.clamp(min=1e-3)).clamp(max=50).to(device)
    criterion = nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world / 16, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))

    best_auc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for step, (x, y) in enumerate(train_loader):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = criterion(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            loss_sum[0] += loss.detach()
            loss_sum[1] += 1
        dist.all_reduce(loss_sum)

        mean_auc = validate(model, val_loader, device)
        if rank == 0:
            logger.info("epoch=%d train_loss=%.4f val_auc=%.4f", epoch,
                        (loss_sum[0] / loss_sum[1]).item(), mean_auc)
            if mean_auc > best_auc:
                best_auc = mean_auc
                torch.save(model.module.state_dict(), os.path.join(args.model_dir, "model.pth"))
                logger.info("new best model (val_auc=%.4f)", best_auc)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
