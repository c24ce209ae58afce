"""Histopathologic cancer detection (PCam 96x96 tiles), 5-fold by WSI, DDP + fold ensemble.

    torchrun --nproc_per_node=8 14_pcam_tiles_kfold.py --train-h5 data/pcam_train.h5 --test-h5 data/pcam_test.h5
"""
import argparse
import os
import time

import h5py
import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import GroupKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

MEAN = torch.tensor([0.702, 0.546, 0.696]).view(3, 1, 1)
STD = torch.tensor([0.239, 0.282, 0.216]).view(3, 1, 1)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-h5", required=True)
    ap.add_argument("--test-h5", required=True)
    ap.add_argument("--meta", default="data/pcam_train_meta.csv", help="tile -> wsi id, label")
    ap.add_argument("--out", default="runs/pcam_resnet50")
    ap.add_argument("--arch", default="resnet50.a1_in1k")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--bs", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


class H5Tiles(Dataset):
    """Opens the HDF5 file lazily so each DataLoader worker gets its own handle."""

    def __init__(self, h5_path, indices, labels=None, train=False):
        self.h5_path, self.indices, self.labels, self.train = h5_path, np.asarray(indices), labels, train
        self._h5 = None

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        if self._h5 is None:
            self._h5 = h5py.File(self.h5_path, "r")
        j = int(self.indices[i])
        x = torch.from_numpy(self._h5["x"][j]).permute(2, 0, 1).float() / 255.0
        if self.train:
            if torch.rand(1) < 0.5:
                x = x.flip(2)
            if torch.rand(1) < 0.5:
                x = x.flip(1)
            x = torch.rot90(x, int(torch.randint(0, 4, (1,))), dims=(1, 2))
            x = x * (1 + 0.1 * (torch.rand(3, 1, 1) - 0.5))
        x = (x - MEAN) / STD
        y = float(self.labels[j]) if self.labels is not None else 0.0
        return x, torch.tensor(y), j


def d4_tta(model, x):
    outs = []
    for k in range(4):
        xr = torch.rot90(x, k, dims=(2, 3))
        outs.append(model(xr))
        outs.append(model(xr.flip(3)))
    return torch.stack(outs).mean(0)


@torch.no_grad()
def infer(model, loader, device, world_size, tta=False):
    model.eval()
    ids, probs = [], []
    for x, _, j in loader:
        x = x.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logit = d4_tta(model, x) if tta else model(x)
        probs.append(torch.sigmoid(logit.float().squeeze(1)).cpu().numpy())
        ids.append(j.numpy())
    parts = [None] * world_size
    dist.all_gather_object(parts, (np.concatenate(ids), np.concatenate(probs)))
    ids = np.concatenate([p[0] for p in parts])
    probs = np.concatenate([p[1] for p in parts])
    ids, keep = np.unique(ids, return_index=True)
    return ids, probs[keep]


def build_model(arch):
    return timm.create_model(arch, pretrained=True, num_classes=1, drop_rate=0.2)


def train_fold(fold, meta, args, rank, local_rank, world_size):
    device = torch.device("cuda", local_rank)
    labels = meta["label"].to_numpy()
    tr_idx = meta.index[meta.fold != fold].to_numpy()
    va_idx = meta.index[meta.fold == fold].to_numpy()
    tr_ds = H5Tiles(args.train_h5, tr_idx, labels, train=True)
    va_ds = H5Tiles(args.train_h5, va_idx, labels)
    tr_dl = DataLoader(tr_ds, args.bs, sampler=DistributedSampler(tr_ds, shuffle=True),
                       num_workers=args.workers, pin_memory=True, drop_last=True)
    va_dl = DataLoader(va_ds, args.bs * 2, sampler=DistributedSampler(va_ds, shuffle=False),
                       num_workers=args.workers, pin_memory=True)

    model = DDP(build_model(args.arch).to(device), device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs, steps_per_epoch=len(tr_dl))

    best_auc, best = 0.0, None
    ckpt_path = os.path.join(args.out, f"fold{fold}.pt")
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for x, y, _ in tr_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logit = model(x).squeeze(1)
            loss = F.binary_cross_entropy_with_logits(logit.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_acc)

        ids, probs = infer(model, va_dl, device, world_size)
        auc = roc_auc_score(labels[ids], probs)
        if rank == 0:
            print(f"fold {fold} ep {epoch} loss {(loss_acc[0] / loss_acc[1]).item():.4f} AUC {auc:.5f} "
                  f"{time.time() - t0:.0f}s", flush=True)
            if auc > best_auc:
                torch.save(model.module.state_dict(), ckpt_path)
        if auc > best_auc:
            best_auc, best = auc, (ids, probs)
    return best_auc, best


def ensemble(args, local_rank, world_size):
    device = torch.device("cuda", local_rank)
    with h5py.File(args.test_h5, "r") as f:
        n_test = f["x"].shape[0]
    ds = H5Tiles(args.test_h5, np.arange(n_test))
    dl = DataLoader(ds, args.bs * 2, sampler=DistributedSampler(ds, shuffle=False), num_workers=args.workers)
    preds = np.zeros(n_test, np.float32)
    for fold in range(args.folds):
        net = timm.create_model(args.arch, pretrained=False, num_classes=1)
        net.load_state_dict(torch.load(os.path.join(args.out, f"fold{fold}.pt"), map_location="cpu"))
        ids, p = infer(net.to(device), dl, device, world_size, tta=True)
        preds[ids] += p / args.folds
    return preds


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.out, exist_ok=True)

    meta = pd.read_csv(args.meta).reset_index(drop=True)
    meta["fold"] = -1
    for f, (_, va) in enumerate(GroupKFold(n_splits=args.folds).split(meta, groups=meta["wsi"])):
        meta.loc[va, "fold"] = f

    oof = np.zeros(len(meta), np.float32)
    for fold in range(args.folds):
        auc, (ids, probs) = train_fold(fold, meta, args, rank, local_rank, world_size)
        oof[ids] = probs
        if rank == 0:
            print(f"== fold {fold}: AUC {auc:.5f}")
    if rank == 0:
        print(f"OOF AUC {roc_auc_score(meta['label'], oof):.5f}")
        np.save(os.path.join(args.out, "oof.npy"), oof)

    dist.barrier()
    test_preds = ensemble(args, local_rank, world_size)
    if rank == 0:
        pd.DataFrame({"idx": np.arange(len(test_preds)), "label": test_preds}).to_csv(
            os.path.join(args.out, "submission.csv"), index=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
