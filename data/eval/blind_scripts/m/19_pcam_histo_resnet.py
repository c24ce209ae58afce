"""
PatchCamelyon (PCam): metastatic tissue detection in 96x96 H&E patches, ResNet-50 fine-tuning.
Data are the official h5 files (camelyonpatch_level_2_split_{train,valid,test}_{x,y}.h5).

    torchrun --standalone --nproc_per_node=8 19_pcam_histo_resnet.py --data_dir /data/pcam --batch_size 64
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
import torchvision
import torchvision.transforms.v2 as T
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class PCamH5(Dataset):
    def __init__(self, data_dir, split, transform):
        self.x_path = os.path.join(data_dir, f"camelyonpatch_level_2_split_{split}_x.h5")
        y_path = os.path.join(data_dir, f"camelyonpatch_level_2_split_{split}_y.h5")
        with h5py.File(y_path, "r") as f:
            self.y = f["y"][:].reshape(-1).astype(np.int64)
        self.transform = transform
        self._x = None  # opened lazily inside each worker

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self._x is None:
            self._x = h5py.File(self.x_path, "r")["x"]
        img = torch.from_numpy(self._x[i]).permute(2, 0, 1)  # uint8 CHW
        return self.transform(img), self.y[i]


MEAN, STD = [0.702, 0.546, 0.696], [0.239, 0.282, 0.216]
train_tf = T.Compose([
    T.RandomHorizontalFlip(), T.RandomVerticalFlip(),
    T.RandomApply([T.RandomRotation(90)], p=0.5),
    T.ColorJitter(0.2, 0.2, 0.1, 0.05),
    T.ToDtype(torch.float32, scale=True), T.Normalize(MEAN, STD),
])
eval_tf = T.Compose([T.ToDtype(torch.float32, scale=True), T.Normalize(MEAN, STD)])


def build_model():
    m = torchvision.models.resnet50(weights="IMAGENET1K_V2")
    m.fc = nn.Linear(m.fc.in_features, 1)
    return m


def init_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return local_rank, dist.get_rank(), dist.get_world_size()


@torch.no_grad()
def score(model, loader, device, world):
    model.eval()
    idx_all, p_all = [], []
    for (x, y), idx in loader:
        logit = model(x.to(device, non_blocking=True)).squeeze(1)
        p_all.append(torch.sigmoid(logit).float().cpu().numpy())
        idx_all.append(idx.numpy())
    mine = (np.concatenate(idx_all), np.concatenate(p_all))
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    idx = np.concatenate([p[0] for p in parts])
    prob = np.concatenate([p[1] for p in parts])
    return idx, prob


class WithIndex(Dataset):
    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return self.ds[i], i


def eval_loader(ds, rank, world, bs):
    # disjoint strided shards, no padding, so every patch is scored exactly once
    wrapped = WithIndex(ds)
    return DataLoader(Subset(wrapped, range(rank, len(ds), world)), batch_size=bs, num_workers=6, pin_memory=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch_size", type=int, default=64, help="per GPU")
    ap.add_argument("--base_lr", type=float, default=1e-4, help="for a global batch of 256")
    ap.add_argument("--warmup_epochs", type=int, default=1)
    ap.add_argument("--out", default="runs/pcam_r50")
    args = ap.parse_args()

    local_rank, rank, world = init_distributed()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds = PCamH5(args.data_dir, "train", train_tf)
    valid_ds = PCamH5(args.data_dir, "valid", eval_tf)
    test_ds = PCamH5(args.data_dir, "test", eval_tf)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                          pin_memory=True, persistent_workers=True)
    valid_dl = eval_loader(valid_ds, rank, world, 256)
    test_dl = eval_loader(test_ds, rank, world, 256)

    model = build_model()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    global_bs = args.batch_size * world
    lr = args.base_lr * global_bs / 256
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    steps_per_epoch = len(train_dl)
    total = args.epochs * steps_per_epoch
    warm = args.warmup_epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + np.cos(np.pi * (s - warm) / (total - warm))))
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world}, global batch {global_bs}, lr {lr:.2e}, {steps_per_epoch} steps/epoch")

    history, best_auc = [], 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        for x, y in train_dl:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True).float()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.binary_cross_entropy_with_logits(model(x).squeeze(1), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            agg += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(agg)

        idx, prob = score(model.module, valid_dl, device, world)
        val_auc = roc_auc_score(valid_ds.y[idx], prob)
        val_acc = float(((prob > 0.5) == valid_ds.y[idx]).mean())
        if rank == 0:
            history.append({"epoch": epoch, "train_loss": (agg[0] / agg[1]).item(), "val_auc": val_auc,
                            "val_acc": val_acc, "time_s": round(time.time() - t0, 1)})
            print(history[-1], flush=True)
            pd.DataFrame(history).to_csv(os.path.join(args.out, "history.csv"), index=False)
            if val_auc > best_auc:
                best_auc = val_auc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    model.module.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location=device))
    idx, prob = score(model.module, test_dl, device, world)
    if rank == 0:
        print(f"test AUC {roc_auc_score(test_ds.y[idx], prob):.4f}  "
              f"acc {((prob > 0.5) == test_ds.y[idx]).mean():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
