"""Multi-label chest X-ray classification (14 findings), DenseNet-121, DDP.

Model selection by mean ROC-AUC over the findings (scikit-learn), computed on the
full validation split after gathering the per-rank predictions.

    torchrun --nproc_per_node=4 09_chestxray_auc_select.py --csv /data/cxr/labels.csv --images /data/cxr/images
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
import torchvision.transforms as T
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

FINDINGS = ["Atelectasis", "Cardiomegaly", "Effusion", "Infiltration", "Mass", "Nodule", "Pneumonia",
            "Pneumothorax", "Consolidation", "Edema", "Emphysema", "Fibrosis", "Pleural_Thickening", "Hernia"]


class CXR(Dataset):
    def __init__(self, df, image_dir, train):
        self.paths = [os.path.join(image_dir, f) for f in df["Image Index"]]
        self.targets = df[FINDINGS].values.astype(np.float32)
        norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        if train:
            self.tf = T.Compose([T.RandomResizedCrop(320, scale=(0.7, 1.0)), T.RandomRotation(7),
                                 T.ToTensor(), norm])
        else:
            self.tf = T.Compose([T.Resize(352), T.CenterCrop(320), T.ToTensor(), norm])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(self.paths[i]).convert("RGB")
        return self.tf(img), torch.from_numpy(self.targets[i])


def mean_auc(probs, targets):
    aucs = []
    for j in range(targets.shape[1]):
        if 0 < targets[:, j].sum() < len(targets):
            aucs.append(roc_auc_score(targets[:, j], probs[:, j]))
        else:
            aucs.append(float("nan"))
    return float(np.nanmean(aucs)), aucs


@torch.no_grad()
def gather_predictions(model, loader, device):
    model.eval()
    probs, targets = [], []
    for x, y in loader:
        probs.append(torch.sigmoid(model(x.to(device, non_blocking=True)).float()))
        targets.append(y.to(device))
    probs, targets = torch.cat(probs), torch.cat(targets)
    world = dist.get_world_size()
    all_probs = [torch.empty_like(probs) for _ in range(world)]
    all_targets = [torch.empty_like(targets) for _ in range(world)]
    dist.all_gather(all_probs, probs)
    dist.all_gather(all_targets, targets)
    model.train()
    return torch.cat(all_probs).cpu().numpy(), torch.cat(all_targets).cpu().numpy()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--csv", required=True, help="one row per image, 0/1 columns per finding, 'split' column")
    parser.add_argument("--images", required=True)
    parser.add_argument("--out", default="checkpoints/cxr_densenet121")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--patience", type=int, default=5)
    parser.add_argument("--amp", action="store_true")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    df = pd.read_csv(args.csv)
    train_ds = CXR(df[df.split == "train"].reset_index(drop=True), args.images, train=True)
    val_ds = CXR(df[df.split == "val"].reset_index(drop=True), args.images, train=False)
    test_ds = CXR(df[df.split == "test"].reset_index(drop=True), args.images, train=False)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    # each image exactly once across ranks
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=64,
                            num_workers=8, pin_memory=True)
    test_loader = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), batch_size=64,
                             num_workers=8, pin_memory=True)

    net = torchvision.models.densenet121(weights="IMAGENET1K_V1")
    net.classifier = nn.Linear(net.classifier.in_features, len(FINDINGS))
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])

    pos = torch.tensor(train_ds.targets.mean(0), device=device)
    criterion = nn.BCEWithLogitsLoss(pos_weight=((1 - pos) / pos.clamp(min=1e-3)).clamp(max=20))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=1e-5)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.1, patience=1)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    os.makedirs(args.out, exist_ok=True)
    best_auc, epochs_since_best = 0.0, 0
    best_file = os.path.join(args.out, "model_best.pth")

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        start = time.time()
        running, n = 0.0, 0
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            running += loss.item()
            n += 1

        probs, targets = gather_predictions(model.module, val_loader, device)
        auc, per_class = mean_auc(probs, targets)
        plateau.step(auc)
        if rank == 0:
            print(f"epoch {epoch:02d} loss {running / n:.4f} val mean-AUC {auc:.4f} "
                  f"lr {optimizer.param_groups[0]['lr']:.1e} ({time.time() - start:.0f}s)", flush=True)
        if auc > best_auc:
            best_auc, epochs_since_best = auc, 0
            if rank == 0:
                torch.save({"epoch": epoch, "state_dict": model.module.state_dict(), "auc": auc,
                            "per_class_auc": dict(zip(FINDINGS, per_class))}, best_file)
        else:
            epochs_since_best += 1
            if epochs_since_best >= args.patience:
                if rank == 0:
                    print(f"stopping: no AUC gain for {args.patience} epochs", flush=True)
                break

    dist.barrier()
    ckpt = torch.load(best_file, map_location=device)
    model.module.load_state_dict(ckpt["state_dict"])
    probs, targets = gather_predictions(model.module, test_loader, device)
    test_auc, per_class = mean_auc(probs, targets)
    if rank == 0:
        print(f"best epoch {ckpt['epoch']} val AUC {ckpt['auc']:.4f} -> test AUC {test_auc:.4f}")
        for name, a in zip(FINDINGS, per_class):
            print(f"  {name:20s} {a:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
