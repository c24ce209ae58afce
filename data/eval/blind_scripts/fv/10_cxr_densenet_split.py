"""Chest X-ray multi-label classification (DenseNet-121, 14 findings).

Horovod -> torch.distributed port. The data comes as one CSV + image folder;
a validation split is carved out of it at start-up.
"""
import argparse
import logging
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, random_split
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms

FINDINGS = ["Atelectasis", "Cardiomegaly", "Effusion", "Infiltration", "Mass", "Nodule", "Pneumonia",
            "Pneumothorax", "Consolidation", "Edema", "Emphysema", "Fibrosis", "Pleural_Thickening", "Hernia"]

log = logging.getLogger(__name__)


def hvd_rank():
    return dist.get_rank()


def hvd_size():
    return dist.get_world_size()


def hvd_local_rank():
    return int(os.environ["LOCAL_RANK"])


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default="/data/cxr14/Data_Entry_2017.csv")
    ap.add_argument("--images", default="/data/cxr14/images")
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-4, help="Adam lr for the global batch")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=2024)
    ap.add_argument("--out", default="checkpoints/cxr")
    return ap.parse_args()


class CXRDataset(Dataset):
    def __init__(self, df, image_dir):
        self.paths = [os.path.join(image_dir, p) for p in df["Image Index"]]
        labels = df["Finding Labels"].str.get_dummies(sep="|")
        self.targets = labels.reindex(columns=FINDINGS, fill_value=0).values.astype(np.float32)
        self.transform = None

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(self.paths[i]).convert("RGB")
        return self.transform(img), torch.from_numpy(self.targets[i])


class TransformSubset(Dataset):
    def __init__(self, subset, transform):
        self.subset, self.transform = subset, transform

    def __len__(self):
        return len(self.subset)

    def __getitem__(self, i):
        ds, idx = self.subset.dataset, self.subset.indices[i]
        img = Image.open(ds.paths[idx]).convert("RGB")
        return self.transform(img), torch.from_numpy(ds.targets[idx])


def build_model():
    model = models.densenet121(weights=models.DenseNet121_Weights.IMAGENET1K_V1)
    model.classifier = nn.Linear(model.classifier.in_features, len(FINDINGS))
    return model


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    probs, targets = [], []
    for x, y in loader:
        x = x.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            probs.append(torch.sigmoid(model(x).float()))
        targets.append(y.to(device))
    probs, targets = torch.cat(probs), torch.cat(targets)
    gathered_p = [torch.zeros_like(probs) for _ in range(hvd_size())]
    gathered_t = [torch.zeros_like(targets) for _ in range(hvd_size())]
    dist.all_gather(gathered_p, probs)
    dist.all_gather(gathered_t, targets)
    p = torch.cat(gathered_p).cpu().numpy()
    t = torch.cat(gathered_t).cpu().numpy()
    aucs = [roc_auc_score(t[:, k], p[:, k]) for k in range(len(FINDINGS)) if 0 < t[:, k].sum() < len(t)]
    model.train()
    return float(np.mean(aucs))


def main():
    args = parse_args()
    torch.cuda.set_device(hvd_local_rank())
    dist.init_process_group("nccl")
    device = torch.device("cuda", hvd_local_rank())
    logging.basicConfig(level=logging.INFO if hvd_rank() == 0 else logging.ERROR)

    # different augmentation streams on each worker
    random.seed(args.seed + hvd_rank())
    np.random.seed(args.seed + hvd_rank())
    torch.manual_seed(args.seed + hvd_rank())

    df = pd.read_csv(args.csv)
    full = CXRDataset(df, args.images)
    n_val = int(len(full) * args.val_fraction)
    train_sub, val_sub = random_split(full, [len(full) - n_val, n_val])

    normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_set = TransformSubset(train_sub, transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.7, 1.0)), transforms.RandomHorizontalFlip(),
        transforms.RandomRotation(7), transforms.ToTensor(), normalize]))
    val_set = TransformSubset(val_sub, transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize]))

    train_sampler = DistributedSampler(train_set, num_replicas=hvd_size(), rank=hvd_rank(), seed=args.seed)
    val_sampler = DistributedSampler(val_set, num_replicas=hvd_size(), rank=hvd_rank(), shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=64, sampler=val_sampler, num_workers=args.workers,
                            pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(build_model()).to(device)
    model = DDP(model, device_ids=[hvd_local_rank()])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.1, patience=1)
    scaler = torch.cuda.amp.GradScaler()

    pos = torch.from_numpy(full.targets.mean(0)).to(device)
    pos_weight = ((1 - pos) / pos.clamp(min=1e-3)).clamp(max=50)

    if hvd_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
    best_auc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        running = torch.zeros(2, device=device)
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(x)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y, pos_weight=pos_weight)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            running += torch.stack([loss.detach() * x.size(0), torch.tensor(float(x.size(0)), device=device)])
        dist.all_reduce(running)

        mean_auc = evaluate(model, val_loader, device)
        scheduler.step(mean_auc)
        log.info("epoch %d train_loss %.4f val_auc %.4f lr %.2e", epoch, (running[0] / running[1]).item(),
                 mean_auc, optimizer.param_groups[0]["lr"])
        if hvd_rank() == 0 and mean_auc > best_auc:
            best_auc = mean_auc
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "auc": mean_auc},
                       os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
