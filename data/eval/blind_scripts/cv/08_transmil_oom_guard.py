"""TransMIL on BRACS-style WSI classification (benign / atypical / malignant), DDP.

Bags are read from <root>/pt_files/<slide_id>.pt.  A handful of resection slides have
>100k patches and the Nystrom attention on those can exceed GPU memory, so training
guards each step.
"""
import argparse
import logging
import os
import random
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from nystrom_attention import NystromAttention
from sklearn.metrics import f1_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("transmil")


@dataclass
class Config:
    root: str = "/datasets/bracs/features_resnet50"
    labels: str = "/datasets/bracs/bracs_3class.csv"  # slide_id, patient_id, label, split_k0..k4
    fold: int = 0
    in_dim: int = 1024
    n_classes: int = 3
    epochs: int = 50
    lr: float = 2e-4
    weight_decay: float = 1e-5
    workers: int = 4
    amp: bool = True
    out: str = "work_dirs/transmil_bracs"
    seed: int = 2023


def get_config():
    cfg = Config()
    ap = argparse.ArgumentParser()
    for k, v in vars(cfg).items():
        ap.add_argument(f"--{k}", type=type(v) if not isinstance(v, bool) else int, default=v)
    ns = ap.parse_args()
    for k in vars(cfg):
        setattr(cfg, k, getattr(ns, k))
    cfg.amp = bool(cfg.amp)
    return cfg


class TransLayer(nn.Module):
    def __init__(self, dim=512):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = NystromAttention(dim=dim, dim_head=dim // 8, heads=8, num_landmarks=dim // 2,
                                     pinv_iterations=6, residual=True, dropout=0.1)

    def forward(self, x):
        return x + self.attn(self.norm(x))


class PPEG(nn.Module):
    def __init__(self, dim=512):
        super().__init__()
        self.proj = nn.Conv2d(dim, dim, 7, 1, 3, groups=dim)
        self.proj1 = nn.Conv2d(dim, dim, 5, 1, 2, groups=dim)
        self.proj2 = nn.Conv2d(dim, dim, 3, 1, 1, groups=dim)

    def forward(self, x, H, W):
        B, _, C = x.shape
        cls_token, feat_token = x[:, 0], x[:, 1:]
        cnn_feat = feat_token.transpose(1, 2).view(B, C, H, W)
        x = self.proj(cnn_feat) + cnn_feat + self.proj1(cnn_feat) + self.proj2(cnn_feat)
        return torch.cat((cls_token.unsqueeze(1), x.flatten(2).transpose(1, 2)), dim=1)


class TransMIL(nn.Module):
    def __init__(self, in_dim, n_classes):
        super().__init__()
        self.pos_layer = PPEG(512)
        self._fc1 = nn.Sequential(nn.Linear(in_dim, 512), nn.ReLU())
        self.cls_token = nn.Parameter(torch.randn(1, 1, 512))
        self.layer1 = TransLayer(512)
        self.layer2 = TransLayer(512)
        self.norm = nn.LayerNorm(512)
        self._fc2 = nn.Linear(512, n_classes)

    def forward(self, data):
        h = self._fc1(data)                                 # B x N x 512
        H = W = int(np.ceil(np.sqrt(h.shape[1])))
        h = torch.cat([h, h[:, : H * W - h.shape[1], :]], dim=1)
        h = torch.cat((self.cls_token.expand(h.shape[0], -1, -1).to(h.dtype), h), dim=1)
        h = self.layer1(h)
        h = self.pos_layer(h, H, W)
        h = self.layer2(h)
        return self._fc2(self.norm(h)[:, 0])


class WSIFeatures(Dataset):
    def __init__(self, table, root):
        self.table = table.reset_index(drop=True)
        self.root = root

    def __len__(self):
        return len(self.table)

    def __getitem__(self, i):
        row = self.table.iloc[i]
        x = torch.load(os.path.join(self.root, "pt_files", f"{row.slide_id}.pt"), map_location="cpu")
        return x, int(row.label), row.slide_id


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@torch.no_grad()
def validate(net, loader, device, world, amp):
    net.eval()
    res = []
    for x, y, sid in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            logits = net(x.to(device, non_blocking=True))
        res.append((sid[0], int(y), logits.float().softmax(-1)[0].cpu().tolist()))
    gathered = [None] * world
    dist.all_gather_object(gathered, res)
    uniq = {sid: (y, p) for part in gathered for sid, y, p in part}
    y = np.array([v[0] for v in uniq.values()])
    p = np.array([v[1] for v in uniq.values()])
    auc = roc_auc_score(y, p, multi_class="ovr")
    f1 = f1_score(y, p.argmax(1), average="macro")
    return auc, f1


def main():
    cfg = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{rank}] %(message)s")
    if rank != 0:
        logger.setLevel(logging.WARNING)
    seed_all(cfg.seed)

    table = pd.read_csv(cfg.labels)
    split_col = f"split_k{cfg.fold}"
    train_set = WSIFeatures(table[table[split_col] == "train"], cfg.root)
    val_set = WSIFeatures(table[table[split_col] == "val"], cfg.root)
    test_set = WSIFeatures(table[table[split_col] == "test"], cfg.root)

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.seed)
    train_loader = DataLoader(train_set, batch_size=1, sampler=train_sampler, num_workers=cfg.workers,
                              pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=cfg.workers, pin_memory=True)
    test_loader = DataLoader(test_set, batch_size=1, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=cfg.workers, pin_memory=True)

    net = TransMIL(cfg.in_dim, cfg.n_classes).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs)

    out_dir = os.path.join(cfg.out, f"fold{cfg.fold}")
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    best_auc = 0.0

    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        tot_loss = torch.zeros(2, device=device)
        for x, y, sid in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            try:
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cfg.amp):
                    logits = model(x)
                    loss = F.cross_entropy(logits.float(), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            except torch.cuda.OutOfMemoryError:
                logger.warning("OOM on %s (%d patches), skipping", sid[0], x.shape[1])
                optimizer.zero_grad(set_to_none=True)
                del x
                torch.cuda.empty_cache()
                continue
            tot_loss[0] += loss.detach()
            tot_loss[1] += 1
        scheduler.step()
        dist.all_reduce(tot_loss)

        val_auc, val_f1 = validate(net, val_loader, device, world, cfg.amp)
        logger.info("epoch %d  train loss %.4f  val auc %.4f  f1 %.4f  (%.0fs)", epoch,
                    (tot_loss[0] / tot_loss[1].clamp(min=1)).item(), val_auc, val_f1, time.time() - tic)
        if rank == 0 and val_auc > best_auc:
            best_auc = val_auc
            torch.save({"model": net.state_dict(), "epoch": epoch, "val_auc": val_auc},
                       os.path.join(out_dir, "best.pth"))
        dist.barrier()

    ckpt = torch.load(os.path.join(out_dir, "best.pth"), map_location=device)
    net.load_state_dict(ckpt["model"])
    test_auc, test_f1 = validate(net, test_loader, device, world, cfg.amp)
    logger.info("fold %d best epoch %d  test auc %.4f  f1 %.4f", cfg.fold, ckpt["epoch"], test_auc, test_f1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
