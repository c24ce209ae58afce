# -*- coding: utf-8 -*-
# 信息流推荐 CTR 预估 —— DeepFM 分布式训练
# 样本：每天的曝光点击日志，特征已经在数仓侧做好 hash，离散特征 id 直接落 parquet
# 启动：torchrun --nproc_per_node=8 03_deepfm_ctr.py --conf conf/deepfm_feed.yaml
import os
import time
import argparse
import logging
from datetime import datetime

import yaml
import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DataLoader, Subset
from sklearn.metrics import roc_auc_score

from feed_infra.monitor import DashboardClient  # 内部指标看板

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
log = logging.getLogger(__name__)


class Config(object):
    def __init__(self, path):
        with open(path) as f:
            d = yaml.safe_load(f)
        self.__dict__.update(d)


class CtrDataset(Dataset):
    """parquet 样本，sparse 列为 hash 后的 id，dense 列已归一化"""

    def __init__(self, files, sparse_cols, dense_cols, label_col="click"):
        dfs = [pd.read_parquet(f, columns=sparse_cols + dense_cols + [label_col]) for f in files]
        df = pd.concat(dfs, ignore_index=True)
        self.sparse = df[sparse_cols].values.astype(np.int64)
        self.dense = df[dense_cols].values.astype(np.float32)
        self.label = df[label_col].values.astype(np.float32)

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        return self.sparse[i], self.dense[i], self.label[i]


class DeepFM(nn.Module):
    def __init__(self, field_dims, num_dense, embed_dim=16, mlp_dims=(400, 400, 400), dropout=0.2):
        super().__init__()
        self.num_fields = len(field_dims)
        self.embeddings = nn.ModuleList([nn.Embedding(d, embed_dim) for d in field_dims])
        self.linear = nn.ModuleList([nn.Embedding(d, 1) for d in field_dims])
        self.dense_linear = nn.Linear(num_dense, 1)
        self.bias = nn.Parameter(torch.zeros(1))
        layers, in_dim = [], self.num_fields * embed_dim + num_dense
        for h in mlp_dims:
            layers += [nn.Linear(in_dim, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Dropout(dropout)]
            in_dim = h
        layers.append(nn.Linear(in_dim, 1))
        self.mlp = nn.Sequential(*layers)
        for emb in self.embeddings:
            nn.init.xavier_uniform_(emb.weight)

    def forward(self, sparse, dense):
        emb = torch.stack([e(sparse[:, i]) for i, e in enumerate(self.embeddings)], dim=1)  # B, F, K
        first = sum(l(sparse[:, i]) for i, l in enumerate(self.linear)) + self.dense_linear(dense) + self.bias
        square_of_sum = emb.sum(dim=1).pow(2)
        sum_of_square = emb.pow(2).sum(dim=1)
        fm = 0.5 * (square_of_sum - sum_of_square).sum(dim=1, keepdim=True)
        deep = self.mlp(torch.cat([emb.flatten(1), dense], dim=1))
        return (first + fm + deep).squeeze(1)


def list_files(data_dir, dates):
    files = []
    for d in dates:
        day_dir = os.path.join(data_dir, "dt={}".format(d))
        files += sorted(os.path.join(day_dir, f) for f in os.listdir(day_dir) if f.endswith(".parquet"))
    return files


@torch.no_grad()
def evaluate(model, val_set, rank, world_size, device, batch_size):
    model.eval()
    shard = Subset(val_set, range(rank, len(val_set), world_size))
    loader = DataLoader(shard, batch_size=batch_size, num_workers=4)
    preds, labels = [], []
    for sparse, dense, label in loader:
        logit = model.module(sparse.to(device), dense.to(device))
        preds.append(torch.sigmoid(logit).cpu().numpy())
        labels.append(label.numpy())
    local = (np.concatenate(preds), np.concatenate(labels))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, local)
    model.train()
    if rank != 0:
        return None, None
    all_pred = np.concatenate([g[0] for g in gathered])
    all_label = np.concatenate([g[1] for g in gathered])
    auc = roc_auc_score(all_label, all_pred)
    logloss = -np.mean(all_label * np.log(all_pred + 1e-7) + (1 - all_label) * np.log(1 - all_pred + 1e-7))
    return auc, logloss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--conf", required=True)
    args = parser.parse_args()
    cfg = Config(args.conf)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda:%d" % local_rank)
    torch.manual_seed(cfg.seed)

    dashboard = None
    if rank == 0:
        dashboard = DashboardClient(project="feed_ctr", exp_name=cfg.exp_name)
        os.makedirs(cfg.ckpt_dir, exist_ok=True)

    train_files = list_files(cfg.data_dir, cfg.train_dates)
    val_files = list_files(cfg.data_dir, cfg.val_dates)
    train_set = CtrDataset(train_files, cfg.sparse_cols, cfg.dense_cols)
    val_set = CtrDataset(val_files, cfg.sparse_cols, cfg.dense_cols)
    if rank == 0:
        log.info("训练样本 %d, 验证样本 %d, 正样本率 %.4f", len(train_set), len(val_set), train_set.label.mean())

    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True,
                              num_workers=cfg.num_workers, pin_memory=True, drop_last=True)

    model = DeepFM(cfg.field_dims, len(cfg.dense_cols), embed_dim=cfg.embed_dim,
                   mlp_dims=tuple(cfg.mlp_dims), dropout=cfg.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    criterion = nn.BCEWithLogitsLoss()

    best_auc = 0.0
    step = 0
    for epoch in range(cfg.epochs):
        model.train()
        t0 = time.time()
        for sparse, dense, label in train_loader:
            sparse = sparse.to(device, non_blocking=True)
            dense = dense.to(device, non_blocking=True)
            label = label.to(device, non_blocking=True)

            logit = model(sparse, dense)
            loss = criterion(logit, label)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1

            if step % cfg.log_interval == 0:
                loss_t = loss.detach().clone()
                dist.all_reduce(loss_t)
                loss_t /= world_size
                if rank == 0:
                    qps = cfg.log_interval * cfg.batch_size * world_size / (time.time() - t0)
                    log.info("epoch %d step %d loss %.5f qps %.0f", epoch, step, loss_t.item(), qps)
                    dashboard.report({"train/loss": loss_t.item(), "train/qps": qps}, step=step)
                t0 = time.time()

        auc, logloss = evaluate(model, val_set, rank, world_size, device, cfg.batch_size * 4)
        if rank == 0:
            log.info("epoch %d 验证集 AUC %.5f logloss %.5f", epoch, auc, logloss)
            dashboard.report({"val/auc": auc, "val/logloss": logloss}, step=step)
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": epoch, "auc": auc, "time": datetime.now().strftime("%Y%m%d%H%M%S")}
            torch.save(ckpt, os.path.join(cfg.ckpt_dir, "epoch_%d.pt" % epoch))
            if auc > best_auc:
                best_auc = auc
                torch.save(model.module.state_dict(), os.path.join(cfg.ckpt_dir, "best.pt"))
        dist.barrier()

    if rank == 0:
        dashboard.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
