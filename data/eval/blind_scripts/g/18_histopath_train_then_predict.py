"""Histopathologic Cancer Detection - train + TTA inference + submission in one go.

    torchrun --nproc_per_node=4 18_histopath_train_then_predict.py --epochs 12 --arch resnext50_32x4d
"""
import argparse
import os

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

MEAN, STD = [0.7024, 0.5462, 0.6964], [0.2389, 0.2821, 0.2163]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="input/histopathologic-cancer-detection")
    p.add_argument("--arch", default="resnext50_32x4d")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--bs", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--ckpt", default="work/best.pth")
    p.add_argument("--sub", default="work/submission.csv")
    return p.parse_args()


class PatchDS(Dataset):
    def __init__(self, ids, labels, folder, tf):
        self.ids, self.labels, self.folder, self.tf = list(ids), labels, folder, tf

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.folder, f"{self.ids[i]}.tif")).convert("RGB")
        y = -1.0 if self.labels is None else float(self.labels[i])
        return self.tf(img), torch.tensor(y)


def build_model(arch):
    return timm.create_model(arch, pretrained=False, num_classes=1)


def save_best(model, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(model.state_dict(), path)


@torch.no_grad()
def predict_probs(net, loader, device, tta=False):
    net.eval()
    out = []
    for x, _ in loader:
        x = x.to(device)
        logit = net(x).squeeze(1)
        if tta:
            logit = (logit + net(torch.flip(x, [3])).squeeze(1) + net(torch.flip(x, [2])).squeeze(1)) / 3
        out.append(torch.sigmoid(logit).cpu())
    return torch.cat(out).numpy()


def gather_preds(local_idx, local_pred, world):
    parts = [None] * world
    dist.all_gather_object(parts, (local_idx, local_pred))
    idx = np.concatenate([p[0] for p in parts])
    pred = np.concatenate([p[1] for p in parts])
    order = np.argsort(idx)
    return pred[order]


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2019)

    labels = pd.read_csv(os.path.join(args.root, "train_labels.csv"))
    tr, va = train_test_split(labels, test_size=0.1, stratify=labels.label, random_state=2019)
    train_tf = T.Compose([T.RandomHorizontalFlip(), T.RandomVerticalFlip(), T.RandomRotation(90),
                          T.ColorJitter(0.1, 0.1, 0.1, 0.05), T.ToTensor(), T.Normalize(MEAN, STD)])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
    train_dir = os.path.join(args.root, "train")
    tr_ds = PatchDS(tr.id, tr.label.values, train_dir, train_tf)
    va_ds = PatchDS(va.id, va.label.values, train_dir, test_tf)

    sampler = DistributedSampler(tr_ds, shuffle=True, drop_last=True)
    tr_dl = DataLoader(tr_ds, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                       pin_memory=True, drop_last=True)
    va_idx = np.arange(rank, len(va_ds), world)
    va_dl = DataLoader(Subset(va_ds, va_idx), batch_size=args.bs * 2, num_workers=args.workers)

    model = DDP(build_model(args.arch).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(tr_dl))
    crit = nn.BCEWithLogitsLoss()
    scaler = torch.cuda.amp.GradScaler()

    best_auc = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in tr_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = crit(model(x).squeeze(1), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
        probs = predict_probs(model.module, va_dl, device)
        val_pred = gather_preds(va_idx, probs, world)
        auc = roc_auc_score(va.label.values, val_pred)
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} val AUC {auc:.5f}", flush=True)
            if auc > best_auc:
                save_best(model, args.ckpt)
        best_auc = max(best_auc, auc)
        dist.barrier()

    # ---------------- inference on the test folder (sharded over ranks) ----------------
    test_dir = os.path.join(args.root, "test")
    test_ids = sorted(f[:-4] for f in os.listdir(test_dir) if f.endswith(".tif"))
    te_ds = PatchDS(test_ids, None, test_dir, test_tf)
    te_idx = np.arange(rank, len(te_ds), world)
    te_dl = DataLoader(Subset(te_ds, te_idx), batch_size=args.bs * 2, num_workers=args.workers)

    net = build_model(args.arch)
    net.load_state_dict(torch.load(args.ckpt, map_location="cpu"))
    net.to(device)
    test_pred = gather_preds(te_idx, predict_probs(net, te_dl, device, tta=True), world)

    if rank == 0:
        pd.DataFrame({"id": test_ids, "label": test_pred}).to_csv(args.sub, index=False)
        print(f"best val AUC {best_auc:.5f}; wrote {args.sub} ({len(test_ids)} rows)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
