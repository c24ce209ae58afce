#!/usr/bin/env python3
# ChestX-ray14 multi-label classifier, patient-grouped 5-fold CV on one node.
#   torchrun --nproc_per_node=4 03_cxr14_multilabel_oof.py --csv data/cxr14_folds.csv --img-root data/images_512
import argparse
import logging
import os
from pathlib import Path

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.transforms as T
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

LABELS = ["Atelectasis", "Cardiomegaly", "Effusion", "Infiltration", "Mass", "Nodule", "Pneumonia",
          "Pneumothorax", "Consolidation", "Edema", "Emphysema", "Fibrosis", "Pleural_Thickening", "Hernia"]

log = logging.getLogger("cxr14")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True, help="csv with Image Index, labels and a 'fold' column")
    ap.add_argument("--img-root", required=True)
    ap.add_argument("--out", default="outputs/cxr14_densenet")
    ap.add_argument("--model", default="densenet121")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--n-folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--bs", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


class CXRDataset(Dataset):
    def __init__(self, df, root, size, train):
        self.files = [os.path.join(root, f) for f in df["Image Index"]]
        self.y = df[LABELS].to_numpy(np.float32)
        self.rows = df.index.to_numpy()
        norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        if train:
            self.tf = T.Compose([T.RandomResizedCrop(size, scale=(0.8, 1.0)),
                                 T.RandomRotation(7), T.ColorJitter(0.1, 0.1), T.ToTensor(), norm])
        else:
            self.tf = T.Compose([T.Resize((size, size)), T.ToTensor(), norm])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = Image.open(self.files[i]).convert("RGB")
        return self.tf(img), torch.from_numpy(self.y[i]), self.rows[i]


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), local_rank, dist.get_world_size()


def mean_auc(y, p):
    aucs = []
    for c in range(y.shape[1]):
        if y[:, c].min() != y[:, c].max():
            aucs.append(roc_auc_score(y[:, c], p[:, c]))
    return float(np.mean(aucs))


@torch.no_grad()
def infer(model, loader, device, world_size):
    model.eval()
    probs, rows = [], []
    for x, _, r in loader:
        x = x.to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            out = (model(x) + model(x.flip(-1))) / 2
        probs.append(out.sigmoid().float().cpu())
        rows.append(r)
    probs = torch.cat(probs)
    rows = torch.cat(rows)

    # every shard has the same length (DistributedSampler pads), so a plain all_gather works
    all_probs = [torch.zeros_like(probs) for _ in range(world_size)]
    all_rows = [torch.zeros_like(rows) for _ in range(world_size)]
    dist.all_gather(all_probs, probs)
    dist.all_gather(all_rows, rows)
    rows = torch.cat(all_rows).numpy()
    probs = torch.cat(all_probs).numpy()
    rows, first = np.unique(rows, return_index=True)
    return rows, probs[first]


def train_one_fold(fold, df, args, rank, local_rank, world_size):
    device = torch.device("cuda", local_rank)
    trn = CXRDataset(df[df.fold != fold], args.img_root, args.size, train=True)
    val = CXRDataset(df[df.fold == fold], args.img_root, args.size, train=False)
    trn_sampler = DistributedSampler(trn, shuffle=True)
    val_sampler = DistributedSampler(val, shuffle=False)
    trn_loader = DataLoader(trn, batch_size=args.bs, sampler=trn_sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True)
    val_loader = DataLoader(val, batch_size=args.bs * 2, sampler=val_sampler, num_workers=args.workers,
                            pin_memory=True)

    net = timm.create_model(args.model, pretrained=True, num_classes=len(LABELS)).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.3, patience=1)
    scaler = torch.cuda.amp.GradScaler()
    # positive weighting for the rare findings, computed on the training split only
    pos = trn.y.mean(0)
    crit = nn.BCEWithLogitsLoss(pos_weight=torch.tensor((1 - pos) / np.clip(pos, 1e-3, None),
                                                        device=device).clamp(max=20.0))

    best_auc, best = -1, None
    for ep in range(args.epochs):
        trn_sampler.set_epoch(ep)
        model.train()
        tot = torch.zeros(2, device=device)
        for step, (x, y, _) in enumerate(trn_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                loss = crit(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            tot[0] += loss.detach().float()
            tot[1] += 1
            if rank == 0 and step % 200 == 0:
                log.info("fold %d ep %d step %d/%d loss %.4f", fold, ep, step, len(trn_loader), loss.item())
        dist.all_reduce(tot)

        rows, probs = infer(model, val_loader, device, world_size)
        auc = mean_auc(df.loc[rows, LABELS].to_numpy(), probs)
        sched.step(auc)
        if rank == 0:
            log.info("fold %d ep %d train_loss %.4f val_mAUC %.4f", fold, ep, (tot[0] / tot[1]).item(), auc)
        if auc > best_auc:
            best_auc, best = auc, (rows, probs)
            if rank == 0:
                torch.save({"state_dict": model.module.state_dict(), "auc": auc, "epoch": ep},
                           Path(args.out) / f"{args.model}_f{fold}.pth")
    return best_auc, best


def main():
    args = get_args()
    rank, local_rank, world_size = setup()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    Path(args.out).mkdir(parents=True, exist_ok=True)

    df = pd.read_csv(args.csv).reset_index(drop=True)
    oof = np.full((len(df), len(LABELS)), np.nan, dtype=np.float32)
    fold_auc = []
    for fold in range(args.n_folds):
        auc, (rows, probs) = train_one_fold(fold, df, args, rank, local_rank, world_size)
        oof[rows] = probs
        fold_auc.append(auc)
        torch.cuda.empty_cache()

    if rank == 0:
        cv = mean_auc(df[LABELS].to_numpy(), oof)
        log.info("fold AUCs %s | OOF mAUC %.4f", np.round(fold_auc, 4).tolist(), cv)
        pd.DataFrame(oof, columns=[f"pred_{c}" for c in LABELS]).assign(
            **{"Image Index": df["Image Index"], "fold": df["fold"]}
        ).to_csv(Path(args.out) / "oof.csv", index=False)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
