"""Multi-label chest X-ray classifier (14 findings), DenseNet-121, AUROC metric.

Keras version: DenseNet121(include_top=False) + Dense(14, sigmoid), ModelCheckpoint
on val_auc, then model.save() for serving. Here the serving artefact is ONNX.

    torchrun --nproc_per_node=4 14_chestxray_densenet_export.py --csv data/cxr14/labels.csv --images data/cxr14/images
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


class CXRDataset(Dataset):
    def __init__(self, df, image_dir, transform):
        self.files = df["Image Index"].tolist()
        self.targets = df[FINDINGS].to_numpy(np.float32)
        self.image_dir, self.transform = image_dir, transform

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.image_dir, self.files[i])).convert("RGB")
        return self.transform(img), torch.from_numpy(self.targets[i])


def build_model(pretrained=True):
    net = torchvision.models.densenet121(weights="IMAGENET1K_V1" if pretrained else None)
    net.classifier = nn.Linear(net.classifier.in_features, len(FINDINGS))
    return net


class ModelCheckpoint:
    def __init__(self, filepath, model, monitor="val_auc"):
        self.filepath, self.model, self.monitor = filepath, model, monitor
        self.best = -np.inf

    def on_epoch_end(self, epoch, logs):
        if logs[self.monitor] > self.best:
            print(f"Epoch {epoch + 1}: {self.monitor} improved from {self.best:.4f} to {logs[self.monitor]:.4f}")
            self.best = logs[self.monitor]
            torch.save(self.model.state_dict(), self.filepath)


@torch.no_grad()
def predict(model, loader, device):
    model.eval()
    probs, targets, loss_sum = [], [], 0.0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x)
        loss_sum += nn.functional.binary_cross_entropy_with_logits(logits.float(), y, reduction="sum").item()
        probs.append(torch.sigmoid(logits.float()).cpu().numpy())
        targets.append(y.cpu().numpy())
    return np.concatenate(probs), np.concatenate(targets), loss_sum


def gather_predictions(probs, targets, loss_sum, world):
    gathered = [None] * world
    dist.all_gather_object(gathered, (probs, targets, loss_sum))
    p = np.concatenate([g[0] for g in gathered])
    t = np.concatenate([g[1] for g in gathered])
    return p, t, sum(g[2] for g in gathered) / (t.size)


def mean_auc(probs, targets):
    aucs = [roc_auc_score(targets[:, k], probs[:, k]) for k in range(targets.shape[1]) if 0 < targets[:, k].sum()
            < len(targets)]
    return float(np.mean(aucs))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True)
    ap.add_argument("--images", required=True)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--out", default="runs/cxr_densenet")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2024)

    df = pd.read_csv(args.csv)
    for f in FINDINGS:
        df[f] = df["Finding Labels"].str.contains(f).astype(np.float32)
    # patient-level split from the official list, identical on every rank
    with open(os.path.join(os.path.dirname(args.csv), "test_list.txt")) as fh:
        test_files = set(fh.read().split())
    val_df = df[df["Image Index"].isin(test_files)].reset_index(drop=True)
    train_df = df[~df["Image Index"].isin(test_files)].reset_index(drop=True)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_ds = CXRDataset(train_df, args.images, T.Compose([
        T.RandomResizedCrop(224, scale=(0.7, 1.0)), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    val_ds = CXRDataset(val_df, args.images, T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=2024)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=64, num_workers=8,
                        pin_memory=True)

    model = DDP(build_model().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.1, patience=1)
    scaler = torch.cuda.amp.GradScaler()
    pos_weight = torch.from_numpy((1 - train_ds.targets.mean(0)) / train_ds.targets.mean(0).clip(1e-3)).to(device)
    criterion = nn.BCEWithLogitsLoss(pos_weight=pos_weight.sqrt())

    best_path = os.path.join(args.out, "densenet121_best.pt")
    checkpoint = ModelCheckpoint(best_path, model, monitor="val_auc")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(x).float(), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if rank == 0 and step % 200 == 0:
                print(f"  [{epoch + 1}:{step}/{len(train_dl)}] loss {loss.item():.4f}", flush=True)

        probs, targets, loss_sum = predict(model, val_dl, device)
        probs, targets, val_loss = gather_predictions(probs, targets, loss_sum, world)
        val_auc = mean_auc(probs, targets)
        plateau.step(val_auc)
        logs = {"val_loss": val_loss, "val_auc": val_auc, "lr": opt.param_groups[0]["lr"]}
        if rank == 0:
            print(f"Epoch {epoch + 1}/{args.epochs} ({time.time() - t0:.0f}s) "
                  + " ".join(f"{k}={v:.4f}" for k, v in logs.items()), flush=True)
            checkpoint.on_epoch_end(epoch, logs)
        dist.barrier()

    if rank == 0:
        export_net = build_model(pretrained=False)
        export_net.load_state_dict(torch.load(best_path, map_location="cpu"))
        export_net.eval()
        torch.onnx.export(export_net, torch.randn(1, 3, 224, 224), os.path.join(args.out, "densenet121_cxr.onnx"),
                          input_names=["image"], output_names=["logits"], dynamic_axes={"image": {0: "batch"}},
                          opset_version=17)
        print("exported ONNX model")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
