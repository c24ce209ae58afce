#!/usr/bin/env python3
# Porto Seguro safe-driver prediction with an FT-Transformer.
# Multi-GPU:  torchrun --nproc_per_node=4 03_porto_ftt_trainer.py --data-dir /data/porto --fold 0
import argparse
import logging
import os
import random
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger(__name__)


@dataclass
class Cfg:
    data_dir: str
    fold: int
    n_folds: int = 5
    epochs: int = 20
    batch_size: int = 1024     # global batch
    lr: float = 2e-4
    d_token: int = 128
    n_blocks: int = 3
    n_heads: int = 8
    dropout: float = 0.15
    seed: int = 7
    workers: int = 6
    out: str = "checkpoints/porto_ftt"


def gini(y, p):
    return 2 * roc_auc_score(y, p) - 1


class PortoDataset(Dataset):
    def __init__(self, frame, cat_cols, num_cols, target="target"):
        self.cat = torch.tensor(frame[cat_cols].values, dtype=torch.long)
        self.num = torch.tensor(frame[num_cols].values, dtype=torch.float32)
        self.y = torch.tensor(frame[target].values, dtype=torch.float32)

    def __len__(self):
        return self.y.shape[0]

    def __getitem__(self, i):
        return self.num[i], self.cat[i], self.y[i]


class FTTransformer(nn.Module):
    def __init__(self, n_num, cards, d, n_blocks, n_heads, dropout):
        super().__init__()
        self.num_weight = nn.Parameter(torch.empty(n_num, d).uniform_(-d ** -0.5, d ** -0.5))
        self.num_bias = nn.Parameter(torch.zeros(n_num, d))
        self.cat_embs = nn.ModuleList([nn.Embedding(c, d) for c in cards])
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        enc = nn.TransformerEncoderLayer(d, n_heads, d * 2, dropout, activation="gelu",
                                         batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc, n_blocks, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, 1)

    def forward(self, x_num, x_cat):
        toks = [x_num.unsqueeze(-1) * self.num_weight + self.num_bias]
        toks.append(torch.stack([emb(x_cat[:, j]) for j, emb in enumerate(self.cat_embs)], 1))
        x = torch.cat([self.cls_token.expand(x_num.size(0), -1, -1)] + toks, 1)
        x = self.encoder(x)
        return self.out(torch.relu(self.norm(x[:, 0]))).squeeze(-1)


def preprocess(df):
    cat_cols = [c for c in df.columns if c.endswith("_cat")]
    bin_cols = [c for c in df.columns if c.endswith("_bin")]
    num_cols = [c for c in df.columns if c.startswith("ps_") and c not in cat_cols + bin_cols]
    df = df.replace(-1, np.nan)
    for c in cat_cols:
        df[c] = df[c].fillna(-1).astype(int) + 1
    df[bin_cols] = df[bin_cols].fillna(0)
    df["missing_count"] = df[num_cols].isna().sum(1)
    num_cols = num_cols + bin_cols + ["missing_count"]
    return df, cat_cols, num_cols


class Trainer:
    def __init__(self, cfg: Cfg):
        self.cfg = cfg
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.is_main = self.rank == 0
        self.writer = SummaryWriter(os.path.join(cfg.out, f"fold{cfg.fold}")) if self.is_main else None
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)

    def setup_data(self):
        df = pd.read_csv(os.path.join(self.cfg.data_dir, "train.csv"))
        df, self.cat_cols, num_cols = preprocess(df)
        skf = StratifiedKFold(self.cfg.n_folds, shuffle=True, random_state=self.cfg.seed)
        tr_idx, va_idx = list(skf.split(df, df["target"]))[self.cfg.fold]
        tr, va = df.iloc[tr_idx].copy(), df.iloc[va_idx].copy()
        med = tr[num_cols].median()
        tr[num_cols], va[num_cols] = tr[num_cols].fillna(med), va[num_cols].fillna(med)
        q_lo, q_hi = tr[num_cols].quantile(0.001), tr[num_cols].quantile(0.999)
        tr[num_cols], va[num_cols] = tr[num_cols].clip(q_lo, q_hi, axis=1), va[num_cols].clip(q_lo, q_hi, axis=1)
        mu, sd = tr[num_cols].mean(), tr[num_cols].std() + 1e-6
        tr[num_cols], va[num_cols] = (tr[num_cols] - mu) / sd, (va[num_cols] - mu) / sd
        self.num_cols = num_cols
        self.cards = [int(df[c].max()) + 1 for c in self.cat_cols]

        self.train_ds = PortoDataset(tr, self.cat_cols, num_cols)
        self.val_ds = PortoDataset(va, self.cat_cols, num_cols)
        per_gpu = self.cfg.batch_size // self.world
        self.train_loader = DataLoader(self.train_ds, batch_size=per_gpu, shuffle=True,
                                       num_workers=self.cfg.workers, pin_memory=True, drop_last=True)
        self.val_sampler = DistributedSampler(self.val_ds, shuffle=False, drop_last=False)
        self.val_loader = DataLoader(self.val_ds, batch_size=4096, sampler=self.val_sampler,
                                     num_workers=2, pin_memory=True)

    def setup_model(self):
        net = FTTransformer(len(self.num_cols), self.cards, self.cfg.d_token, self.cfg.n_blocks,
                            self.cfg.n_heads, self.cfg.dropout).to(self.device)
        self.model = DistributedDataParallel(net, device_ids=[self.local_rank])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr, weight_decay=1e-5)
        steps = self.cfg.epochs * len(self.train_loader)
        self.sched = torch.optim.lr_scheduler.OneCycleLR(self.opt, max_lr=self.cfg.lr, total_steps=steps,
                                                         pct_start=0.1)
        self.criterion = nn.BCEWithLogitsLoss()

    def train_epoch(self, epoch):
        self.model.train()
        total = torch.zeros(2, device=self.device)
        for x_num, x_cat, y in self.train_loader:
            x_num, x_cat, y = (t.to(self.device, non_blocking=True) for t in (x_num, x_cat, y))
            loss = self.criterion(self.model(x_num, x_cat), y)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), 5.0)
            self.opt.step()
            self.sched.step()
            total[0] += loss.detach() * y.numel()
            total[1] += y.numel()
        dist.all_reduce(total)
        return (total[0] / total[1]).item()

    @torch.no_grad()
    def validate(self):
        net = self.model.module
        net.eval()
        preds = []
        for x_num, x_cat, _ in self.val_loader:
            preds.append(torch.sigmoid(net(x_num.to(self.device), x_cat.to(self.device))))
        local = torch.cat(preds)
        # DistributedSampler without shuffle hands rank r the rows r, r+W, r+2W, ... (padded at the end)
        n_pad = len(self.val_sampler)
        gathered = [torch.empty(n_pad, device=self.device) for _ in range(self.world)]
        dist.all_gather(gathered, local)
        full = torch.stack(gathered, 1).reshape(-1)[: len(self.val_ds)].cpu().numpy()
        return gini(self.val_ds.y.numpy(), full), full

    def fit(self):
        best = -1.0
        os.makedirs(self.cfg.out, exist_ok=True) if self.is_main else None
        for epoch in range(self.cfg.epochs):
            loss = self.train_epoch(epoch)
            score, preds = self.validate()
            if self.is_main:
                log.info("epoch %d  train_loss %.5f  val_gini %.5f", epoch, loss, score)
                self.writer.add_scalar("train/loss", loss, epoch)
                self.writer.add_scalar("val/gini", score, epoch)
                if score > best:
                    best = score
                    torch.save(self.model.module.state_dict(), os.path.join(self.cfg.out, f"fold{self.cfg.fold}.pt"))
                    np.save(os.path.join(self.cfg.out, f"oof_fold{self.cfg.fold}.npy"), preds)
        if self.is_main:
            log.info("fold %d best gini %.5f", self.cfg.fold, best)
            self.writer.close()
        dist.barrier()
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--out", default="checkpoints/porto_ftt")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cfg = Cfg(data_dir=a.data_dir, fold=a.fold, epochs=a.epochs, batch_size=a.batch_size, lr=a.lr, out=a.out)
    trainer = Trainer(cfg)
    trainer.setup_data()
    trainer.setup_model()
    trainer.fit()


if __name__ == "__main__":
    main()
