"""Multi-label chest X-ray classifier (DenseNet-121, 14 findings) with early stopping.

    torchrun --standalone --nproc_per_node=4 08_chestxray_densenet_earlystop.py \
        --csv /data/cxr14/Data_Entry_2017.csv --images /data/cxr14/images
"""
import argparse
import logging
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms

FINDINGS = ["Atelectasis", "Cardiomegaly", "Effusion", "Infiltration", "Mass", "Nodule",
            "Pneumonia", "Pneumothorax", "Consolidation", "Edema", "Emphysema", "Fibrosis",
            "Pleural_Thickening", "Hernia"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True)
    p.add_argument("--images", required=True)
    p.add_argument("--split-dir", default="/data/cxr14/splits")
    p.add_argument("--out", default="/shared/cxr/densenet121")
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--patience", type=int, default=4)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class CXR(Dataset):
    def __init__(self, df, root, train):
        self.paths = df["Image Index"].tolist()
        labels = df["Finding Labels"].str.split("|")
        self.y = np.stack([[float(f in ls) for f in FINDINGS] for ls in labels]).astype(np.float32)
        self.root = root
        norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        if train:
            self.tf = transforms.Compose([transforms.RandomResizedCrop(320, scale=(0.7, 1.0)),
                                          transforms.RandomRotation(7),
                                          transforms.ToTensor(), norm])
        else:
            self.tf = transforms.Compose([transforms.Resize(320), transforms.ToTensor(), norm])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, self.paths[i])).convert("RGB")
        return self.tf(img), torch.from_numpy(self.y[i])


def build_model():
    m = models.densenet121(weights=models.DenseNet121_Weights.IMAGENET1K_V1)
    m.classifier = nn.Linear(m.classifier.in_features, len(FINDINGS))
    return m


@torch.no_grad()
def validate(model, loader, device, criterion):
    model.eval()
    probs, targets, losses = [], [], []
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        losses.append(criterion(logits.float(), y).item())
        probs.append(torch.sigmoid(logits.float()).cpu())
        targets.append(y.cpu())
    model.train()
    probs = torch.cat(probs).numpy()
    targets = torch.cat(targets).numpy()
    aucs = []
    for k in range(len(FINDINGS)):
        if targets[:, k].min() != targets[:, k].max():
            aucs.append(roc_auc_score(targets[:, k], probs[:, k]))
    return float(np.mean(losses)), float(np.mean(aucs)), aucs


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s r{rank} %(levelname)s %(message)s",
                        handlers=[logging.FileHandler(os.path.join("/tmp", f"cxr_rank{rank}.log")),
                                  logging.StreamHandler()] if rank == 0 else
                        [logging.FileHandler(os.path.join("/tmp", f"cxr_rank{rank}.log"))])
    log = logging.getLogger("cxr")

    df = pd.read_csv(args.csv)
    # patient-level split is fixed on disk, identical for every rank
    train_ids = set(open(os.path.join(args.split_dir, "train_val_list.txt")).read().split())
    val_ids = set(open(os.path.join(args.split_dir, "val_list.txt")).read().split())
    train_df = df[df["Image Index"].isin(train_ids - val_ids)].reset_index(drop=True)
    val_df = df[df["Image Index"].isin(val_ids)].reset_index(drop=True)

    train_ds, val_ds = CXR(train_df, args.images, True), CXR(val_df, args.images, False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=64, sampler=val_sampler,
                        num_workers=args.workers, pin_memory=True)

    pos = torch.tensor(train_ds.y.mean(0))
    criterion = nn.BCEWithLogitsLoss(pos_weight=((1 - pos) / pos.clamp(min=1e-3)).clamp(max=20).to(device))

    model = DDP(build_model().to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.1, patience=1)

    os.makedirs(args.out, exist_ok=True)
    last_path = os.path.join(args.out, "last.pt")
    start_epoch, best_auc, bad_epochs = 0, 0.0, 0
    if os.path.exists(last_path):
        ck = torch.load(last_path, map_location=device)
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        plateau.load_state_dict(ck["plateau"])
        start_epoch, best_auc, bad_epochs = ck["epoch"] + 1, ck["best_auc"], ck["bad_epochs"]
        log.info("resumed at epoch %d (best AUROC %.4f)", start_epoch, best_auc)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for step, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = criterion(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
            if step % 100 == 0:
                log.info("epoch %d step %d loss %.4f", epoch, step, loss.item())
        dist.all_reduce(loss_sum)

        val_loss, mean_auc, aucs = validate(model, val_dl, device, criterion)
        plateau.step(mean_auc)

        stop = torch.zeros(1, device=device)
        if rank == 0:
            log.info("epoch %d train_loss %.4f val_loss %.4f mean_AUROC %.4f (%.0fs)", epoch,
                     (loss_sum[0] / loss_sum[1]).item(), val_loss, mean_auc, time.time() - t0)
            if mean_auc > best_auc:
                best_auc, bad_epochs = mean_auc, 0
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
                log.info("new best AUROC %.4f", best_auc)
            else:
                bad_epochs += 1
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "plateau": plateau.state_dict(), "epoch": epoch, "best_auc": best_auc,
                        "bad_epochs": bad_epochs}, last_path + ".tmp")
            os.replace(last_path + ".tmp", last_path)
            if bad_epochs >= args.patience:
                stop.fill_(1)
        dist.broadcast(stop, src=0)
        if stop.item():
            if rank == 0:
                log.info("early stopping at epoch %d, best AUROC %.4f", epoch, best_auc)
            break

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
