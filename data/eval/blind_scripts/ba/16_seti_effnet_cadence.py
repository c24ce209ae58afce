"""SETI Breakthrough Listen - E.T. Signal Search.

on-target cadence rows (0, 2, 4) stacked vertically -> 1 channel image, efficientnetv2, mixup, 4 folds.
torchrun --nproc_per_node=4 16_seti_effnet_cadence.py
"""
import os
import time
from dataclasses import dataclass, field

import albumentations as A
import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class CFG:
    data_dir: str = "/data/seti-breakthrough-listen"
    out_dir: str = "./seti_v2m"
    model_name: str = "tf_efficientnetv2_m_in21k"
    size: tuple = (768, 768)
    epochs: int = 20
    batch_size: int = 16
    lr: float = 1e-4
    weight_decay: float = 1e-6
    mixup_alpha: float = 1.0
    folds: list = field(default_factory=lambda: [0, 1, 2, 3])
    seed: int = 42
    num_workers: int = 8


class SETIDataset(Dataset):
    def __init__(self, df, data_dir, train):
        self.ids, self.targets = df.id.values, df.target.values.astype(np.float32)
        self.data_dir, self.train = data_dir, train
        self.aug = A.Compose([A.Resize(*CFG.size), A.HorizontalFlip(p=0.5), A.VerticalFlip(p=0.5)]) if train \
            else A.Compose([A.Resize(*CFG.size)])

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        x = np.load(os.path.join(self.data_dir, "train", self.ids[i][0], f"{self.ids[i]}.npy")).astype(np.float32)
        x = np.vstack([x[0], x[2], x[4]])  # (3*273, 256)
        x = ((x - x.mean()) / (x.std() + 1e-6)).T
        x = self.aug(image=x)["image"]
        return torch.from_numpy(x[None]), torch.tensor(self.targets[i]), i


class SETIModel(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.net = timm.create_model(name, pretrained=True, in_chans=1, num_classes=1)

    def forward(self, x):
        return self.net(x).squeeze(-1)


def mixup(x, y, alpha):
    lam = float(np.random.beta(alpha, alpha))
    perm = torch.randperm(x.size(0), device=x.device)
    return lam * x + (1 - lam) * x[perm], y, y[perm], lam


def train_fn(model, loader, crit, opt, sched, scaler, cfg):
    model.train()
    losses = []
    for images, labels, _ in loader:
        images = images.cuda()
        labels = labels.cuda()
        images, ya, yb, lam = mixup(images, labels, cfg.mixup_alpha)
        with torch.cuda.amp.autocast():
            logits = model(images)
            loss = lam * crit(logits, ya) + (1 - lam) * crit(logits, yb)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        losses.append(loss.item())
    return float(np.mean(losses))


@torch.no_grad()
def valid_fn(model, loader):
    model.eval()
    idx, preds = [], []
    for images, _, i in loader:
        images = images.cuda()
        with torch.cuda.amp.autocast():
            preds.append(torch.sigmoid(model(images).float()).cpu().numpy())
        idx.append(i.numpy())
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (np.concatenate(idx), np.concatenate(preds)))
    out = np.zeros(len(loader.dataset), np.float32)
    for i, p in parts:
        out[i] = p
    return out


def run_fold(fold, df, cfg, rank, local_rank):
    trn, val = df[df.fold != fold].reset_index(drop=True), df[df.fold == fold].reset_index(drop=True)
    trn_ds, val_ds = SETIDataset(trn, cfg.data_dir, True), SETIDataset(val, cfg.data_dir, False)
    trn_sampler = DistributedSampler(trn_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    trn_dl = DataLoader(trn_ds, batch_size=cfg.batch_size, sampler=trn_sampler,
                        num_workers=cfg.num_workers, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=cfg.batch_size * 2, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=cfg.num_workers, pin_memory=True)

    model = SETIModel(cfg.model_name).to(torch.device("cuda", local_rank))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=cfg.epochs * len(trn_dl), pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler()
    crit = nn.BCEWithLogitsLoss()

    best = 0.0
    for epoch in range(cfg.epochs):
        trn_sampler.set_epoch(epoch)
        t0 = time.time()
        loss = torch.tensor(train_fn(model, trn_dl, crit, opt, sched, scaler, cfg), device=f"cuda:{local_rank}")
        dist.all_reduce(loss)
        loss = loss.item() / dist.get_world_size()
        pred = valid_fn(model.module, val_dl)
        auc = roc_auc_score(val.target.values, pred)
        if rank == 0:
            print(f"fold {fold} epoch {epoch} loss {loss:.4f} auc {auc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if auc > best:
                best = auc
                torch.save(model.module.state_dict(), os.path.join(cfg.out_dir, f"{cfg.model_name}_fold{fold}.pth"))
                val.assign(pred=pred).to_csv(os.path.join(cfg.out_dir, f"oof_fold{fold}.csv"), index=False)
        dist.barrier()
    return best


def main():
    cfg = CFG()
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed)
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)

    df = pd.read_csv(os.path.join(cfg.data_dir, "train_folds.csv"))
    scores = {f: run_fold(f, df, cfg, rank, local_rank) for f in cfg.folds}
    if rank == 0:
        oof = pd.concat([pd.read_csv(os.path.join(cfg.out_dir, f"oof_fold{f}.csv")) for f in cfg.folds])
        print("fold auc", scores, f"OOF auc {roc_auc_score(oof.target, oof.pred):.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
