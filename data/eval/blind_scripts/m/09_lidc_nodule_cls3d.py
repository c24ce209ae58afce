"""
Benign vs malignant lung nodule classification on LIDC-IDRI 3D patches (48^3 voxels, 1 mm iso).

patches.h5:  /patches (N, 48, 48, 48) int16 HU,  /labels (N,) int8,  /patient (N,) bytes
folds.csv:   patient_id, fold

Resumable: the job scheduler kills us after 24 h, the array job restarts with --resume.

  torchrun --nproc_per_node=4 09_lidc_nodule_cls3d.py --fold 0 --resume runs/lidc_f0/last.pt
"""
import argparse
import os
import time

import h5py
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

HU_MIN, HU_MAX = -1000.0, 400.0


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--h5", default="/data/lidc/patches48.h5")
    p.add_argument("--folds", default="/data/lidc/folds.csv")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", default=None)
    p.add_argument("--resume", default=None)
    return p.parse_args()


class NodulePatches(Dataset):
    def __init__(self, h5_path, indices, augment):
        self.h5_path = h5_path
        self.indices = np.asarray(indices)
        self.augment = augment
        with h5py.File(h5_path, "r") as f:
            self.labels = f["labels"][:][self.indices].astype(np.int64)
        self.f = None

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        if self.f is None:
            self.f = h5py.File(self.h5_path, "r")
        vol = self.f["patches"][self.indices[i]].astype(np.float32)
        vol = (np.clip(vol, HU_MIN, HU_MAX) - HU_MIN) / (HU_MAX - HU_MIN)
        if self.augment:
            k = np.random.randint(4)
            vol = np.rot90(vol, k, axes=(1, 2))
            for ax in range(3):
                if np.random.rand() < 0.5:
                    vol = np.flip(vol, ax)
            sh = np.random.randint(-3, 4, size=3)
            vol = np.roll(vol, tuple(sh), axis=(0, 1, 2))
        vol = vol[8:40, 8:40, 8:40]  # 32^3 centre
        return torch.from_numpy(np.ascontiguousarray(vol))[None], self.labels[i]


def conv_bn(cin, cout, stride=1):
    return nn.Sequential(nn.Conv3d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm3d(cout), nn.ReLU(inplace=True))


class Res3D(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.a = conv_bn(cin, cout, stride)
        self.b = nn.Sequential(nn.Conv3d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm3d(cout))
        self.skip = (nn.Sequential(nn.Conv3d(cin, cout, 1, stride, bias=False), nn.BatchNorm3d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        return F.relu(self.b(self.a(x)) + self.skip(x))


class NoduleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = conv_bn(1, 32)
        self.layers = nn.Sequential(Res3D(32, 32, 1), Res3D(32, 64, 2), Res3D(64, 128, 2), Res3D(128, 256, 2))
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(256, 2)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(self.drop(F.adaptive_avg_pool3d(x, 1).flatten(1)))


def make_splits(h5_path, folds_csv, fold):
    folds = pd.read_csv(folds_csv)
    with h5py.File(h5_path, "r") as f:
        patient = np.array([p.decode() for p in f["patient"][:]])
    val_patients = set(folds.loc[folds.fold == fold, "patient_id"])
    is_val = np.array([p in val_patients for p in patient])
    return np.where(~is_val)[0], np.where(is_val)[0]


@torch.no_grad()
def evaluate(net, loader, device, world):
    net.eval()
    probs, ys = [], []
    for x, y in loader:
        p = F.softmax(net(x.to(device, non_blocking=True)), dim=1)[:, 1]
        probs.append(p.cpu().numpy())
        ys.append(y.numpy())
    out = [None] * world
    dist.all_gather_object(out, (np.concatenate(probs), np.concatenate(ys)))
    probs = np.concatenate([o[0] for o in out])
    ys = np.concatenate([o[1] for o in out])
    return roc_auc_score(ys, probs), ((probs > 0.5) == ys).mean()


def main():
    args = parse_args()
    args.out = args.out or f"runs/lidc_f{args.fold}"
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tr_idx, va_idx = make_splits(args.h5, args.folds, args.fold)
    train_ds = NodulePatches(args.h5, tr_idx, augment=True)
    val_ds = NodulePatches(args.h5, va_idx, augment=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                          pin_memory=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=64, num_workers=4)

    # class imbalance: ~1 malignant : 2.5 benign
    pos_frac = train_ds.labels.mean()
    class_w = torch.tensor([1.0 / (1 - pos_frac), 1.0 / pos_frac], device=device)
    class_w = class_w / class_w.sum() * 2

    model = NoduleNet().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    start_epoch, best_auc = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best_auc = ckpt["epoch"] + 1, ckpt["best_auc"]
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch} (best AUC {best_auc:.4f})")

    os.makedirs(args.out, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, weight=class_w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            agg += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        sched.step()
        dist.all_reduce(agg)
        auc, acc = evaluate(model.module, val_dl, device, world)
        if rank == 0:
            print(f"[fold {args.fold}] ep {epoch:3d} loss {(agg[0] / agg[1]).item():.4f} "
                  f"val AUC {auc:.4f} acc {acc:.4f}  {time.time() - t0:.0f}s", flush=True)
            if auc > best_auc:
                best_auc = auc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_model.pt"))
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best_auc": best_auc}, os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
